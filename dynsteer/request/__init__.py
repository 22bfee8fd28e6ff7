"""What turns a request's configuration into programs, independent of any worker or engine.

``compile_spec`` compiles steering specs (and a dynamic policy) into what one table row holds for a phase;
``compile_policy`` lays a dynamic policy out over gate slots; ``programs`` holds the compiled values. Nothing here
imports ``dynsteer.steering``, ``dynsteer.engine`` or vLLM: the frontend, the engine core and the workers compile
alike.
"""

__all__: list[str] = []  # the frontend, the engine core and the workers compile with it; users never do
