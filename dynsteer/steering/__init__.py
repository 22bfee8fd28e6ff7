"""The worker, per step: one model instance's steering tables, live requests and tiers (architecture §1).

:mod:`dynsteer.steering.runtime`'s :class:`~dynsteer.steering.runtime.SteeringRuntime` coordinates; the request
registry (``requests``, ``rows``), the site tables and hooks (``tables``, ``site``), a step's arrays (``batch``), the
dynamic tier (``dynamic/``), the stream tier (``publish``) and capture delivery (``delivery``) each keep their own
state. The engine builds all of it (``dynsteer.engine.build``); users steer through :mod:`dynsteer.api` and the
schemas, so this room exports nothing.
"""

__all__: list[str] = []
