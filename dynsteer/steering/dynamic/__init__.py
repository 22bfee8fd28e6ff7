"""The worker's dynamic tier: a request's gate slots driven step by step.

A policy's rules each own one *gate slot* (plus one for a controller's monitor when no rule uses it). The decode row
of a request carries, at the monitor's site, the probe that computes the slot's gate, and at each action's site the
gated vector or clamp that reads it (compiled by ``dynsteer.request.compile_policy``; architecture §3/§4). The forward
writes every slot's score and effective gate into persistent ``[G, N]`` buffers; each token's gate is
``gate = g·mul + add`` with two multipliers per slot:

=================  ==========================  ===========================================================
scope              mul, add                    where ``mul, add`` come from
=================  ==========================  ===========================================================
``this_token``     ``d, 0``                    ``1, 0`` without a controller; else ``d`` = its scale
``next_step``      ``0, d·g(previous token)``  the sync tier
``rest_of_request`` ``d, 0`` → ``0, d`` once fired  the sync tier
=================  ==========================  ===========================================================

The sync tier runs on the device and the host never waits for it (``driver``); custom Python controllers keep a
host path that waits for the previous step. Every rank runs this on identical inputs, so every rank takes the same
decisions.

Modules, one per concern: ``state`` (a request's :class:`~dynsteer.steering.dynamic.state.DynState`),
``prompt_gates`` (gates decided at the prompt's last token and held), ``driver`` (the per-step control, update and
read-back), ``traces`` (finished requests' traces until taken) and ``tier`` (what the runtime calls: the tier, or
its null version in an engine without one).
"""
