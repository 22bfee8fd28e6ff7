"""``torch.ops.dynsteer.steer_site`` / ``steer_site_dyn`` / ``steer_add_rms_norm``: the custom ops wrapping the
steering implementations (``steer_add_rms_norm``: sites fused into the add-norm that follows them).

The ops are opaque to torch.compile (a fake impl provides shapes), so the real implementation is
chosen at run time by :func:`select_impl`, the single dispatch point:

* ``DYNSTEER_KERNEL=reference`` or ``=triton`` forces one implementation (``triton`` on CPU
  tensors only works with ``TRITON_INTERPRET=1`` set before the kernel module is imported);
* otherwise (unset / ``auto``): CUDA tensors -> Triton kernel, everything else -> torch reference.

Semantics: see ``dynsteer.kernels.reference`` (static) and ``dynsteer.kernels.dynamic_reference``
(dynamic: monitors and gated terms; declared to mutate ``gates`` and ``scores``).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from dynsteer.kernels import site_summary
from dynsteer.kernels.dynamic_reference import steer_site_dyn_reference
from dynsteer.kernels.reference import stash_residual, steer_site_reference
from dynsteer.kernels.site_tables import DYNAMIC_FIELDS, STATIC_FIELDS, SiteTables

__all__ = ["DYN_OP_NAME", "FUSED_OP_NAME", "OP_NAME", "ENV_KERNEL", "TRACED_FUSED_OP_NAME", "no_stage",
           "select_controller_impl", "select_impl", "select_readback_impl", "steer_add_rms_norm", "steer_site",
           "steer_site_dyn", "use_traced_fused"]

OP_NAME = "dynsteer::steer_site"
DYN_OP_NAME = "dynsteer::steer_site_dyn"
ENV_KERNEL = "DYNSTEER_KERNEL"

SteerImpl = Callable[..., torch.Tensor]
_N_STATIC = len(STATIC_FIELDS)


def forced_kernel() -> str:
    """``DYNSTEER_KERNEL`` as set now (lower case, ``""`` when unset): read on every call, so tests and launch
    scripts can flip it late."""
    return os.environ.get(ENV_KERNEL, "").strip().lower()


def runs_reference(t: torch.Tensor) -> bool:
    """The one dispatch rule: the torch reference for tensors off CUDA, Triton on CUDA, unless ``DYNSTEER_KERNEL``
    forces one."""
    forced = forced_kernel()
    return forced == "reference" or (forced != "triton" and not t.is_cuda)


def select_impl(h: torch.Tensor, dynamic: bool = False) -> SteerImpl:
    """Return the implementation that should run for ``h`` (the one dispatch decision).

    Read on every call (a dict lookup) so tests and launch scripts can flip the env var late.

    Args:
        h: the branch tensor; only its device is inspected.
        dynamic: pick an implementation of ``steer_site_dyn`` instead of ``steer_site``.

    Returns:
        ``steer_site_triton`` / ``steer_site_reference``, or with ``dynamic``
        ``steer_site_dyn_triton`` / ``steer_site_dyn_reference``.
    """
    forced = forced_kernel()
    if forced not in ("", "auto", "reference", "triton"):
        raise ValueError(f"{ENV_KERNEL}={forced!r}: expected 'reference', 'triton' or 'auto'")
    if runs_reference(h):
        return steer_site_dyn_reference if dynamic else steer_site_reference
    # Imported lazily: triton may be absent on CPU installs, and the jit decorator fixes
    # interpreted-vs-compiled mode at import time.
    from dynsteer.kernels.triton_steer import steer_site_dyn_triton, steer_site_triton

    return steer_site_dyn_triton if dynamic else steer_site_triton


def select_controller_impl(t: torch.Tensor) -> tuple[Callable[..., None], Callable[..., None]]:
    """The device sync tier's ``(control, update)`` kernels for tensors on ``t``'s device (same rule as
    :func:`select_impl`: Triton on CUDA, the torch reference elsewhere, ``DYNSTEER_KERNEL`` forces one)."""
    if runs_reference(t):
        from dynsteer.kernels.controller_reference import control_reference, update_reference

        return control_reference, update_reference
    from dynsteer.kernels.triton_controller import control_triton, update_triton

    return control_triton, update_triton


def select_readback_impl(t: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The dynamic tier's read-back gather for tensors on ``t``'s device (same rule as
    :func:`select_controller_impl`)."""
    if runs_reference(t):
        from dynsteer.kernels.controller_reference import readback_reference

        return readback_reference
    from dynsteer.kernels.triton_controller import readback_triton

    return readback_triton


def _op_registered(name: str) -> bool:
    # hasattr on the namespace resolves registered ops and is False for unknown names.
    return hasattr(torch.ops.dynsteer, name)


def _site_signature(fields: tuple[str, ...]) -> inspect.Signature:
    """``(h, r, row_index, <fields>, stage, stage_slot) -> Tensor``: a site op's flat signature, from which
    ``custom_op`` infers its schema."""
    tensor, optional = torch.Tensor, Optional[torch.Tensor]
    names = [("h", tensor), ("r", optional), ("row_index", tensor), *((f, tensor) for f in fields),
             ("stage", tensor), ("stage_slot", optional)]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind, annotation=a) for n, a in names], return_annotation=tensor)


def _register_site_op(name: str, fields: tuple[str, ...], mutates: tuple[str, ...]) -> None:
    """Define ``dynsteer::<name>`` once per process (a second import or a reload is a no-op): the site op over the
    ``SiteTables`` ``fields``. torch.library takes flat tensors, so this is the one place a :class:`SiteTables`
    becomes the op's arguments (the schema, from ``fields``) and is rebuilt from them (the implementation)."""
    if _op_registered(name):
        return
    n, dynamic = len(fields), len(fields) > len(STATIC_FIELDS)

    def impl(h: torch.Tensor, r: Optional[torch.Tensor], row_index: torch.Tensor, *args: Any) -> torch.Tensor:
        # Looks select_impl up through module globals on each call, so importlib.reload of this
        # module updates the behaviour of the already-registered op.
        return select_impl(h, dynamic)(h, r, row_index, SiteTables(*args[:n]), args[n], args[n + 1])

    impl.__signature__ = _site_signature(fields)  # type: ignore[attr-defined]
    # stage (the capture buffer) is a required tensor, empty when the place captures nothing: an optional mutable
    # argument breaks both eager dispatch (None) and Dynamo tracing.
    op = torch.library.custom_op(f"dynsteer::{name}", mutates_args=mutates)(impl)
    # the mutated tensors are declared in mutates_args: only the output needs a shape
    op.register_fake(lambda h, *args: torch.empty_like(h))


_register_site_op(OP_NAME.split("::")[1], STATIC_FIELDS, ("stage",))
_register_site_op(DYN_OP_NAME.split("::")[1], DYNAMIC_FIELDS, ("gates", "scores", "stage"))


def steer_site(h: torch.Tensor, r: Optional[torch.Tensor], row_index: torch.Tensor, tables: SiteTables,
               stage: Optional[torch.Tensor] = None, stage_slot: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Call ``torch.ops.dynsteer.steer_site`` on the static six of ``tables`` (contract:
    ``dynsteer.kernels.reference``).

    Arguments and result: see ``steer_site_reference`` (the contract every implementation shares).
    """
    return torch.ops.dynsteer.steer_site(h, r, row_index, *tables[:_N_STATIC], no_stage(h) if stage is None else stage,
                                         stage_slot)


def steer_site_dyn(h: torch.Tensor, r: Optional[torch.Tensor], row_index: torch.Tensor, tables: SiteTables,
                   stage: Optional[torch.Tensor] = None, stage_slot: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Call ``torch.ops.dynsteer.steer_site_dyn`` on every field of ``tables`` (contract:
    ``dynsteer.kernels.dynamic_reference``).

    Arguments and result: see ``steer_site_dyn_reference``; ``tables.gates``, ``tables.scores`` (and ``stage``) are
    updated in place.
    """
    return torch.ops.dynsteer.steer_site_dyn(h, r, row_index, *tables, no_stage(h) if stage is None else stage,
                                             stage_slot)


def no_stage(h: torch.Tensor) -> torch.Tensor:
    """The empty capture buffer: the ops' ``stage`` argument when nothing is captured."""
    return h.new_empty((0, h.shape[-1]))


# ---- residual capture ------------------------------------------------------------------------------------------
STASH_OP_NAME = "dynsteer::stash_residual"


def _stash_impl(h: torch.Tensor, r: Optional[torch.Tensor], out: torch.Tensor,
               slot: Optional[torch.Tensor] = None) -> None:
    # The unsteered residual stream h + r of the tokens the host gave a slot this step, into a persistent buffer.
    # The "op" forward passes the buffer to the steering op instead (no extra kernel); "inline" forwards use this.
    if out.is_cuda and forced_kernel() != "reference":
        from dynsteer.kernels.triton_steer import stash_triton

        stash_triton(h, r, out, slot)  # the reference selects rows with nonzero: a device sync, not graph safe
    else:
        stash_residual(h, r, out, slot)


def _register_stash() -> None:
    if hasattr(torch.ops.dynsteer, "stash_residual"):
        return
    op = torch.library.custom_op(STASH_OP_NAME, mutates_args=("out",))(_stash_impl)
    op.register_fake(lambda h, r, out, slot=None: None)


_register_stash()


# ---- steering sites fused into the following add + RMS norm ---------------------------------------------------
FUSED_OP_NAME = "dynsteer::steer_add_rms_norm"


def _fused_impl(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, row_index: torch.Tensor,
                tabs_a: list[torch.Tensor], tabs_b: list[torch.Tensor], gate_bufs: list[torch.Tensor],
                stage_a: torch.Tensor, stage_b: torch.Tensor, stage_slot: Optional[torch.Tensor],
                unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    reference = runs_reference(h)
    # An eager call (never while a CUDA graph is captured: the graph must hold the full kernel) whose sites are both
    # idle this step and capture nothing: the add-norm alone, the same bits for a cheaper launch (site_summary).
    if (not stage_a.numel() and not stage_b.numel() and site_summary.idle(tabs_a) and site_summary.idle(tabs_b)
            and not (h.is_cuda and torch.cuda.is_current_stream_capturing())):
        if reference:
            from dynsteer.kernels.fused_reference import add_rms_norm_reference as plain
        else:
            from dynsteer.kernels.triton_fused import add_rms_norm_triton as plain
        return plain(h, r, weight, eps, unit_offset)
    if reference:
        from dynsteer.kernels.fused_reference import steer_add_rms_norm_reference as impl
    else:
        from dynsteer.kernels.triton_fused import steer_add_rms_norm_triton as impl
    return impl(h, r, weight, eps, row_index, tabs_a, tabs_b, gate_bufs, stage_a, stage_b, stage_slot, unit_offset)


def _fused_fake(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, row_index: torch.Tensor,
                tabs_a: list[torch.Tensor], tabs_b: list[torch.Tensor], gate_bufs: list[torch.Tensor],
                stage_a: torch.Tensor, stage_b: torch.Tensor, stage_slot: Optional[torch.Tensor],
                unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(h), torch.empty_like(h)


def _register_fused() -> None:
    """Defined on a ``torch.library.Library`` directly, not with ``torch.library.custom_op``: in eager steps (every
    prefill larger than the captured sizes) it is called once per fused norm, and custom_op's Python dispatch layers
    cost ~2.5x the host time per call (30 vs 12 us for this signature on a 2-core EPYC). Same schema, so
    torch.compile functionalizes its mutations the same way (tests/test_kernels_fused.py::
    test_op_under_torch_compile)."""
    if hasattr(torch.ops.dynsteer, "steer_add_rms_norm"):
        return
    from dynsteer.kernels.library import LIB

    name = FUSED_OP_NAME.split("::")[1]
    LIB.define(name + torch.library.infer_schema(_fused_impl, mutates_args=("gate_bufs", "stage_a", "stage_b")))
    LIB.impl(name, _fused_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(FUSED_OP_NAME, _fused_fake, lib=LIB)


_register_fused()

TRACED_FUSED_OP_NAME = "dynsteer::steer_add_rms_norm_traced"
ENV_FUSED_LAUNCH = "DYNSTEER_FUSED_LAUNCH"


def _fused_traced_impl(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, row_index: torch.Tensor,
                       tabs_a: list[torch.Tensor], tabs_b: list[torch.Tensor], gate_bufs: list[torch.Tensor],
                       stage_a: torch.Tensor, stage_b: torch.Tensor, stage_slot: Optional[torch.Tensor],
                       unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from dynsteer.kernels.triton_fused import steer_add_rms_norm_triton

    return steer_add_rms_norm_triton(h, r, weight, eps, row_index, tabs_a, tabs_b, gate_bufs, stage_a, stage_b,
                                     stage_slot, unit_offset, traced=True)


def _register_fused_traced() -> None:
    """``steer_add_rms_norm`` as a ``torch.library.triton_op``: the same kernel, the same schema, but torch.compile
    sees the launch and emits it in its generated code like one of its own kernels, instead of calling back into
    Python through the dispatcher for every norm. That matters in compiled steps that run without a CUDA graph
    (token counts above vLLM's captured sizes: prefills while requests arrive): on the H200 a compiled chain of the
    64 opaque op calls of an 8B forward took 3.6-4.0 ms of host time against 0.08-0.09 ms for vLLM's own
    add-norms (measured by a benchmark since removed; ``benchmarks/README.md`` says what replaced it). The traced op
    always launches the full kernel (an eager call's idle shortcut, :mod:`site_summary`, is a host decision a compiled graph cannot take); CUDA graphs held the full
    kernel already. Used only while compiling on CUDA (:func:`use_traced_fused`)."""
    if hasattr(torch.ops.dynsteer, "steer_add_rms_norm_traced"):
        return
    if importlib.util.find_spec("triton") is None:  # triton_op needs it importable, not a GPU
        return
    torch.library.triton_op(TRACED_FUSED_OP_NAME, mutates_args=("gate_bufs", "stage_a", "stage_b"))(
        _fused_traced_impl)


_register_fused_traced()


def use_traced_fused(h: torch.Tensor) -> bool:
    """Whether a fused site pair on ``h`` should call the traced op: while torch.compile traces a CUDA forward with
    the Triton kernels selected (``DYNSTEER_KERNEL`` not ``reference``) and the op registered; ``DYNSTEER_FUSED_LAUNCH=
    opaque`` keeps the opaque op (the dispatcher path) for comparison."""
    if not (h.is_cuda and torch.compiler.is_compiling()):
        return False
    if forced_kernel() == "reference":
        return False
    if os.environ.get(ENV_FUSED_LAUNCH, "").strip().lower() == "opaque":
        return False
    return hasattr(torch.ops.dynsteer, "steer_add_rms_norm_traced")


def steer_add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, row_index: torch.Tensor,
                       tabs_a: list[torch.Tensor], tabs_b: list[torch.Tensor], gate_bufs: list[torch.Tensor],
                       stage_a: Optional[torch.Tensor] = None, stage_b: Optional[torch.Tensor] = None,
                       stage_slot: Optional[torch.Tensor] = None,
                       unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``torch.ops.dynsteer.steer_add_rms_norm`` (contract: ``dynsteer.kernels.fused_reference``): up to two
    steering sites, then vLLM's fused add + RMS norm (``unit_offset``: Gemma's); returns ``(normed, residual)``."""
    op = torch.ops.dynsteer.steer_add_rms_norm_traced if use_traced_fused(h) else torch.ops.dynsteer.steer_add_rms_norm
    return op(
        h, r, weight, eps, row_index, list(tabs_a), list(tabs_b), list(gate_bufs),
        no_stage(h) if stage_a is None else stage_a, no_stage(h) if stage_b is None else stage_b, stage_slot,
        unit_offset)
