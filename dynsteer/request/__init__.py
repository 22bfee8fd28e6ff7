"""A request's configuration, independent of any worker or engine.

``payload`` encodes and decodes it on the wire (``extra_args["dynsteer"]``); ``resolve`` applies the precedence
global < request < command once, giving the effective specs per phase and the effective dynamic policy;
``compile_spec`` compiles steering specs (and a dynamic policy) into what one table row holds for a phase;
``compile_policy`` lays a dynamic policy out over gate slots; ``programs`` holds the compiled values. Nothing here
imports ``dynsteer.steering``, ``dynsteer.engine`` or vLLM: the frontend, the engine core and the workers resolve and
compile alike.
"""

__all__: list[str] = []  # the frontend, the engine core and the workers compile with it; users never do
