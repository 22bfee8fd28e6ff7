"""benchmarks/overhead.py's sizing of tensor-parallel engines: model memory per rank and the GPUs' free memory (no GPU
needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from lib import engines  # noqa: E402
from lib.engines import LLAMA3_8B, kv_bytes_per_token, shape_config, weight_bytes  # noqa: E402


def test_weights_are_the_published_parameter_counts():
    assert weight_bytes(LLAMA3_8B, 1) == 8_030_261_248
    assert weight_bytes(shape_config("llama3-70b"), 1) == 70_553_706_496


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_ranks_split_the_matrices_and_each_hold_the_norms(tp):
    cfg = shape_config("llama3-70b")
    norms = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"] * 2
    whole = weight_bytes(cfg, 2)
    per_rank = weight_bytes(cfg, 2, tp)
    assert tp * (per_rank - norms) == pytest.approx(whole - norms, abs=2 * tp)
    assert per_rank < whole / tp + norms


def test_kv_heads_split_and_replicate_past_their_count():
    cfg = shape_config("llama3-70b")  # 8 KV heads of 128
    one = kv_bytes_per_token(cfg, 2)
    assert one == 80 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(cfg, 2, 4) == one // 4
    assert kv_bytes_per_token(cfg, 2, 8) == kv_bytes_per_token(cfg, 2, 16) == one // 8  # one head a rank at least


def test_fewer_layers_keep_the_layer_shape():
    cfg = shape_config("llama3-70b", layers=32)
    assert cfg["num_hidden_layers"] == 32 and cfg["hidden_size"] == 8192 and cfg["intermediate_size"] == 28672
    assert shape_config("llama3-70b")["num_hidden_layers"] == 80  # the catalogue is not changed


def fake_smi(rows: list[tuple[str, int, int]], seen: list):
    def run(cmd, **kw):
        seen.append(cmd)
        wanted = cmd[cmd.index("-i") + 1].split(",")
        lines = [f"{rows[int(i)][0]}, {rows[int(i)][1]}, {rows[int(i)][2]}" for i in wanted if int(i) < len(rows)]
        return SimpleNamespace(stdout="\n".join(lines) + "\n")
    return run


def test_gpu_memory_of_several_gpus_is_the_least_free(monkeypatch):
    seen: list = []
    rows = [("NVIDIA H100", 81559, 80000), ("NVIDIA H100", 81559, 60000), ("NVIDIA H100", 81559, 70000)]
    monkeypatch.setattr(subprocess, "run", fake_smi(rows, seen))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engines.gpu_memory() == ("NVIDIA H100", 81559 << 20, 80000 << 20)
    assert engines.gpu_memory(3) == ("NVIDIA H100 x3", 81559 << 20, 60000 << 20)
    assert engines.gpu_memory(4) is None  # fewer GPUs than ranks
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert engines.gpu_memory(2) == ("NVIDIA H100 x2", 81559 << 20, 70000 << 20)
    assert seen[-1][seen[-1].index("-i") + 1] == "2,0"
    assert engines.gpu_memory(3) is None  # only two visible


def test_cpu_smoke_refuses_more_than_two_ranks(monkeypatch, capsys):
    import overhead

    monkeypatch.setattr(sys, "argv", ["overhead.py", "--cpu-smoke", "--tp", "4"])
    with pytest.raises(SystemExit):
        overhead.parse_args()
    assert "--tp 2" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--tp", "4", "--shape", "llama3-70b", "--layers", "32"])
    args = overhead.parse_args()
    assert (args.tp, args.shape, args.layers) == (4, "llama3-70b", 32)
