"""Persistent device tables for every hooked (layer, site); the row pool that shares rows between requests is in
``dynsteer.steering.rows``.

Each hooked site owns the tables :class:`dynsteer.kernels.site_tables.SiteTables` defines (their shapes, dtypes and
defaults are declared there): the vector, clamps and ``row_live`` flags of every row (1 a non-zero vector, 2 a clamp
with non-zero strength, 4 monitors, 8 dyn terms; the kernels skip the site for a row whose flags are 0 and load only
the flagged tables otherwise), and with a dynamic tier (G > 0) the row's monitors and dyn terms. Row 0 holds nothing,
so its ``row_live`` entry carries the site's summary instead: the OR of the flags of every row tokens may read this
step (a superset: ``write_row`` ORs a new row in, :meth:`SteeringTables.summarize` narrows it to the batch's rows). A
kernel finding it 0 skips the site for every token without the dependent load of a token's row flags (one load in
the chain of every steered token at every site it does not steer: ~35 µs per forward on an 8B model at batch 64 for
one steered site of 96). Shared by all sites: ``row_index[max_tokens]`` (int32) and, with G > 0, the per-token gate
buffers ``gate_mul/gate_add`` (staged by the host) and ``gates/scores`` (written by monitors, read by later sites),
each ``[G, max_tokens]`` float32. Row 0 is all zeros and is what padding and unsteered tokens read. Tensors are
allocated once, before vLLM profiles memory, and only ever written in place, so CUDA graphs captured over them stay
valid; each site's :class:`SiteTables` is built once here, and the hook in its layer hands it to the kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dynsteer.kernels import site_summary
from dynsteer.kernels.site_tables import GATE_FIELDS, LAYOUT, SITE_FIELDS, STATIC_FIELDS, SiteTables
from dynsteer.spec import Site
from dynsteer.request.programs import RowContent, SiteKey


# row_live bits (the kernels test the same values)
_LIVE_VEC, _LIVE_CLAMP, _LIVE_MON, _LIVE_DYN = 1, 2, 4, 8


class SteeringTables:
    """The device tensors; each hooked site owns its own tensors, handed to the hook installed in its layer.

    Each site's tensors are standalone allocations, not views of one big table: compiled graphs have been seen
    to snapshot module buffers that are views (steering then stops working under torch.compile on GPU), while
    standalone buffers are read live.
    """

    def __init__(self, sites: list[SiteKey], hidden_size: int, num_rows: int, max_clamps: int, max_tokens: int,
                 device: torch.device | str | None = None, max_gates: int = 0) -> None:
        self.sites = list(sites)
        self.slot = {key: i for i, key in enumerate(self.sites)}
        self.hidden_size, self.num_rows, self.max_clamps, self.max_gates = hidden_size, num_rows, max_clamps, max_gates
        sizes = dict(R=num_rows, K=max_clamps, H=hidden_size, G=max_gates, N=max_tokens)

        def alloc(name: str) -> torch.Tensor:
            table = LAYOUT[name]
            return torch.full(table.shape(sizes), table.fill, dtype=table.dtype, device=device)

        fields = SITE_FIELDS if max_gates else STATIC_FIELDS
        self._site: dict[SiteKey, dict[str, torch.Tensor]] = {
            key: {name: alloc(name) for name in fields} for key in self.sites}
        # per row, the sites whose tables hold something other than the defaults, and which field groups there
        self._dirty: list[dict[SiteKey, frozenset[str]]] = [{} for _ in range(num_rows)]
        # host mirror of row_live per (site, row), and of each site's summary (row 0's device entry)
        self._live = np.zeros((len(self.sites), num_rows), np.int32)
        self._summary = np.zeros(len(self.sites), np.int32)
        for i, key in enumerate(self.sites):  # the fused op's eager calls skip idle sites from the host copy
            site_summary.watch(self._site[key]["row_live"], self._summary, i)
        self.row_index = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.device = self.row_index.device
        # Standalone tensors (not views of one buffer), for the same reason as the site tables.
        self.gate_buffers: dict[str, torch.Tensor] = {name: alloc(name) for name in GATE_FIELDS} if max_gates else {}
        # each site's tables as the kernels take them, built once
        self._tables = {key: SiteTables(**self._site[key], **self.gate_buffers) for key in self.sites}

    def views(self, layer: int, site: Site) -> dict[str, torch.Tensor]:
        """The site's own tables by name (without the shared gate buffers)."""
        return self._site[(layer, site)]

    def site_tables(self, layer: int, site: Site) -> SiteTables:
        """The site's tables as its kernels take them (the same tensors, built once)."""
        return self._tables[(layer, site)]

    def vec_at(self, key: SiteKey, row: int) -> torch.Tensor:
        """The additive vector a row holds at one site (for inspection and tests)."""
        return self._site[key]["vec"][row]

    def write_row(self, row: int, content: RowContent) -> None:
        """Write one row: at the sites ``content`` touches and those its row's previous content touched, the field
        groups (vector, clamps, monitors, dyn terms) either one holds, and there the row's ``row_live`` flags;
        everything else already holds the defaults (flags 0).

        All fields go up in one host-to-device copy per dtype (pinned, non-blocking: admission never stalls the
        stream) and are scattered on the device by one multi-tensor copy. Before, every (site, field) pair was a
        synchronous pageable copy (~1,250 per row on an 8B model), then every field of a touched site went up
        (~200 KB per site with a dynamic tier, mostly zeros); a plain vector now moves its own 4H bytes (and its
        site's 4-byte ``row_live``, in the int32 copy)."""
        if row == 0:
            raise ValueError("row 0 is the identity (and carries the sites' summaries): it is never written")
        old = self._dirty[row]
        new = {key: _groups(prog) for key, prog in content.sites.items()}
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[np.ndarray]]] = {}
        for key in self.sites:
            wanted = new.get(key, frozenset()) | old.get(key, frozenset())
            if not wanted:
                continue
            tensors, prog = self._site[key], content.sites.get(key)
            pairs = [(tensors[name][row], src) for name, src in self._fields(prog, wanted)]
            i = self.slot[key]
            self._live[i, row] = int(pairs[-1][1])  # _fields ends with row_live
            summary = self._summary[i] | self._live[i, row]  # a superset until the next summarize()
            if summary != self._summary[i]:
                self._summary[i] = summary
                pairs.append((tensors["row_live"][0], np.array(summary, np.int32)))
            for dst, src in pairs:
                dsts, srcs = groups.setdefault(dst.dtype, ([], []))
                dsts.append(dst)
                srcs.append(src)
        for dtype, (dsts, srcs) in groups.items():
            self._upload(dsts, srcs, dtype)
        self._dirty[row] = {key: g for key, g in new.items() if g}

    def summarize(self, rows: np.ndarray) -> None:
        """Set every site's summary (row 0's ``row_live`` entry) to the OR of ``rows``' flags there: the rows the
        next steps' tokens read, until the batch or a row changes (then the runtime calls this again; a row written
        in between is ORed in by ``write_row``). Only changed summaries go up, in one non-blocking copy."""
        rows = np.asarray(rows, np.int64)
        new = (np.bitwise_or.reduce(self._live[:, rows], axis=1) if rows.size
               else np.zeros(len(self.sites), np.int32)).astype(np.int32)
        changed = np.flatnonzero(new != self._summary)
        if changed.size:
            self._summary[changed] = new[changed]
            self._upload([self._site[self.sites[i]]["row_live"][0] for i in changed],
                         [new[i:i + 1] for i in changed], torch.int32)

    def summaries(self) -> dict[SiteKey, int]:
        """Each site's current summary flags (host mirror; for inspection and tests)."""
        return {key: int(self._summary[i]) for i, key in enumerate(self.sites)}

    def _upload(self, dsts: list[torch.Tensor], srcs: list[np.ndarray], dtype: torch.dtype) -> None:
        np_dtype = np.float32 if dtype == torch.float32 else np.int32
        flat = np.concatenate([np.asarray(s, np_dtype).ravel() for s in srcs])
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":
            # the caching host allocator keeps the pinned block until the copy has run
            host = torch.empty(host.shape, dtype=dtype, device="cpu", pin_memory=True).copy_(host)
            staged = host.to(self.device, non_blocking=True)
        else:
            staged = host
        views = [v.view(d.shape) for v, d in zip(torch.split(staged, [d.numel() for d in dsts]), dsts)]
        torch._foreach_copy_(dsts, views)

    def _fields(self, prog: Any, wanted: frozenset[str]) -> list[tuple[str, np.ndarray]]:
        """The ``wanted`` field groups' values for one site (``prog`` None: the defaults), then ``row_live``.

        ``wanted`` covers every group ``prog`` sets, so the flags are derived from the values written here: a
        kernel that trusts them skips exactly what would have been a no-op."""
        K, H, G = self.max_clamps, self.hidden_size, self.max_gates
        fields: list[tuple[str, np.ndarray]] = []
        live = 0
        if "vec" in wanted:
            vec = prog.vec if prog is not None and prog.vec is not None else np.zeros(H, np.float32)
            fields.append(("vec", vec))
            live |= _LIVE_VEC if np.any(np.asarray(vec, np.float32) != 0) else 0  # as uploaded
        if "clamp" in wanted:
            cdir = np.zeros((K, H), np.float32)
            lo, hi = np.full(K, -np.inf, np.float32), np.full(K, np.inf, np.float32)
            strength, cgate = np.zeros(K, np.float32), np.full(K, -1, np.int32)
            for k, c in enumerate(prog.clamps if prog is not None else ()):
                cdir[k], lo[k], hi[k], strength[k], cgate[k] = c.direction, c.lo, c.hi, c.strength, c.gate
            fields += [("clamp_dir", cdir), ("clamp_lo", lo), ("clamp_hi", hi), ("clamp_strength", strength)]
            live |= _LIVE_CLAMP if np.any(strength != 0) else 0
            if G:
                fields.append(("clamp_gate", cgate))
        if "mon" in wanted and G:
            probe = np.zeros((G, H), np.float32)
            sharp, thresh, floor = np.zeros(G, np.float32), np.zeros(G, np.float32), np.zeros(G, np.float32)
            mon_mask = 0
            for s, m in (prog.monitors.items() if prog is not None else ()):
                probe[s], sharp[s], thresh[s], floor[s] = m.probe, m.sharpness, m.threshold, m.floor
                mon_mask |= 1 << s
            fields += [("mon_mask", np.array(mon_mask, np.int32)), ("mon_probe", probe), ("mon_sharp", sharp),
                       ("mon_thresh", thresh), ("mon_floor", floor)]
            live |= _LIVE_MON if mon_mask else 0
        if "dyn" in wanted and G:
            dvec, dyn_mask = np.zeros((G, H), np.float32), 0
            for s, v in (prog.dyn.items() if prog is not None else ()):
                dvec[s] = v
                dyn_mask |= 1 << s
            fields += [("dyn_mask", np.array(dyn_mask, np.int32)), ("dyn_vec", dvec)]
            live |= _LIVE_DYN if dyn_mask else 0
        fields.append(("row_live", np.array(live, np.int32)))
        return fields

    def nbytes(self) -> int:
        per_site = sum(t.numel() * t.element_size() for t in next(iter(self._site.values()), {}).values())
        shared = [self.row_index, *self.gate_buffers.values()]
        return per_site * len(self._site) + sum(t.numel() * t.element_size() for t in shared)


def _groups(prog: Any) -> frozenset[str]:
    """The field groups a site program sets away from the defaults (what ``write_row`` must upload or reset)."""
    return frozenset(name for name, on in (("vec", prog.vec is not None), ("clamp", bool(prog.clamps)),
                                           ("mon", bool(prog.monitors)), ("dyn", bool(prog.dyn))) if on)
