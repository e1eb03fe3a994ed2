"""The checkpoint validator against a corpus of corrupt and hostile checkpoints: every
case is refused by the library validator and by `load_model` with a CheckpointError that names the
problem and a fix; a representative subset goes through each command's CLI (`generate`, `package`,
`quantize`, `export`, `build`): exit code 2, one `error:` line with a hint, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import CheckpointError
from pipeline.model import checkpoint as ck
from pipeline.model.files import FILE_LIMITS, checkpoint_files
from pipeline.model.validate import validate_checkpoint

EMBED = "model.decoder.embed_tokens.weight"
NORM = "model.decoder.norm.weight"
Q0 = "model.decoder.layers.0.self_attn.q_proj.weight"


# ---- mutations: each turns a valid tiny checkpoint into one corrupt case -------------------------------
def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


def _save(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, d / "model.safetensors")


def _with(**change) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        t = _tensors(d)
        for name, fn in change.items():
            key = {"embed": EMBED, "norm": NORM, "q0": Q0}[name]
            t[key] = fn(t[key])
        _save(d, t)

    return apply


def _drop(name: str) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        t = _tensors(d)
        del t[name]
        _save(d, t)

    return apply


def _add(name: str, value: torch.Tensor) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        _save(d, {**_tensors(d), name: value})

    return apply


def _truncate(keep: Callable[[int], int]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        f = d / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: keep(len(data))])

    return apply


def _config(**change) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in change.items():
            if k.startswith("text_") and k != "text_config":
                cfg["text_config"][k[5:]] = v
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))

    return apply


def _write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    return apply


def _link(name: str, target: str | Callable[[Path], Path]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        dest = target(d) if callable(target) else Path(target)
        if (d / name).exists():
            (d / name).unlink()
        (d / name).symlink_to(dest)

    return apply


def _outside_copy(name: str) -> Callable[[Path], Path]:
    def where(d: Path) -> Path:
        other = d.parent / f"elsewhere-{name}"
        shutil.copyfile(d / name, other)
        return other

    return where


def _pickle(name: str, remove_safetensors: bool) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        torch.save({"w": torch.zeros(2)}, d / name)  # written here, never loaded by dgpipe
        if remove_safetensors:
            (d / "model.safetensors").unlink()

    return apply


def _index(wmap: Callable[[dict[str, str]], object]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        names = list(_tensors(d))
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": wmap(dict.fromkeys(names, "model.safetensors"))})
        )

    return apply


def _point(first: str) -> Callable[[dict[str, str]], dict[str, str]]:
    return lambda m: {**m, next(iter(m)): first}


def _per_expert_without_one(d: Path) -> None:
    out = {}
    for name, t in _tensors(d).items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, 0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            out.update({f"{prefix}{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    del out["model.decoder.layers.0.experts.3.up_proj.weight"]
    _save(d, out)


def _fifo(d: Path) -> None:
    os.mkfifo(d / "extra.json")


def _set(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[3] = value
        return t

    return fn


BIG = 65 << 20  # past every bound of FILE_LIMITS


def _oversize(name: str) -> Callable[[Path], None]:
    """`name` one byte past its bound (a sparse file: nothing that size is written)."""

    def apply(d: Path) -> None:
        (d / name).touch()
        os.truncate(d / name, FILE_LIMITS[name] + 1)

    return apply


def _generation(**change) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        f = d / "generation_config.json"
        (f).write_text(json.dumps({**json.loads(f.read_text()), **change}))

    return apply


NOT_UTF8 = b'{"chat_template": "\xff\xfe {{ messages }}"}'  # Latin-1 bytes in a JSON string

CASES: dict[str, Callable[[Path], None]] = {
    # truncated / unreadable weights
    "truncated-tail": _truncate(lambda n: n - 100),
    "truncated-half": _truncate(lambda n: n // 2),
    "truncated-header": _truncate(lambda n: 4),
    "empty-weights": _truncate(lambda n: 0),
    "garbage-weights": _write("model.safetensors", os.urandom(4096)),
    "no-weights": lambda d: (d / "model.safetensors").unlink(),
    # pickle: refused, never loaded, never copied
    "pickle-only": _pickle("pytorch_model.bin", remove_safetensors=True),
    "pickle-beside-safetensors": _pickle("pytorch_model.bin", remove_safetensors=False),
    "pickle-training-args": _pickle("training_args.bin", remove_safetensors=False),
    "pickle-pt": _pickle("model.pt", remove_safetensors=True),
    "pickle-in-subdir": lambda d: ((d / "sub").mkdir(), _pickle("sub/optimizer.pth", False)(d)),
    # wrong shapes, missing / extra tensors, wrong dtypes
    "shape-transposed-embed": _with(embed=lambda t: t.t().contiguous()),
    "shape-short-norm": _with(norm=lambda t: t[:-1].contiguous()),
    "shape-extra-dim": _with(q0=lambda t: t[None]),
    "config-hidden-mismatch": _config(text_hidden_size=64),
    "config-layers-mismatch": _config(text_num_hidden_layers=4),
    "missing-tensor": _drop(Q0),
    "missing-norm": _drop(NORM),
    "missing-expert": _per_expert_without_one,
    "extra-unknown-tensor": _add("foo.bar", torch.zeros(2)),
    "extra-decoder-tensor": _add("model.decoder.layers.9.self_attn.q_proj.weight", torch.zeros(2, 2)),
    "extra-expert-index": _add("model.decoder.layers.0.experts.7.down_proj.weight", torch.zeros(32, 16)),
    "int32-tensor": _with(norm=lambda t: t.to(torch.int32)),
    "int64-tensor": _with(embed=lambda t: t.to(torch.int64)),
    "bool-tensor": _with(norm=lambda t: t > 0),
    "float64-tensor": _with(q0=lambda t: t.double()),
    "uint8-unquantized": _with(q0=lambda t: t.to(torch.uint8)),
    # non-finite weights
    "nan-weight": _with(q0=_set(float("nan"))),
    "inf-weight": _with(embed=_set(float("inf"))),
    "neg-inf-bf16": _with(norm=lambda t: _set(float("-inf"))(t).bfloat16()),
    # symlinks and special files
    "symlink-notes-etc-passwd": _link("notes.txt", "/etc/passwd"),
    "symlink-tokenizer-dev-zero": _link("tokenizer.json", "/dev/zero"),
    "symlink-config-dev-zero": _link("config.json", "/dev/zero"),
    "symlink-config-outside": _link("config.json", _outside_copy("config.json")),
    "symlink-weights-outside": _link("model.safetensors", _outside_copy("model.safetensors")),
    "symlink-dangling": _link("vocab.json", "does-not-exist.json"),
    "symlink-dir-outside": _link("extras", "/etc"),
    "fifo-in-checkpoint": _fifo,
    # index files
    "index-parent-dir": _index(_point("../elsewhere.safetensors")),
    "index-absolute": _index(_point("/etc/passwd")),
    "index-pickle-shard": _index(_point("pytorch_model.bin")),
    "index-missing-shard": _index(_point("model-00002-of-00002.safetensors")),
    "index-empty-map": _index(lambda m: {}),
    "index-not-object": _write("model.safetensors.index.json", "[1, 2]"),
    "index-not-json": _write("model.safetensors.index.json", "{"),
    # config.json values and shapes
    "config-list": _write("config.json", "[]"),
    "config-null": _write("config.json", "null"),
    "config-string": _write("config.json", '"diffusion_gemma"'),
    "config-not-json": _write("config.json", "{model_type: diffusion_gemma"),
    "config-not-utf8": _write("config.json", b"\xff\xfe{}"),
    "config-huge": lambda d: os.truncate(d / "config.json", BIG),
    "config-missing": lambda d: (d / "config.json").unlink(),
    "config-text-list": _config(text_config=[1]),
    "config-model-type": _config(model_type="llama"),
    "vocab-size-negative": _config(text_vocab_size=-1),
    "canvas-length-zero": _config(canvas_length=0),
    "sliding-window-zero": _config(text_sliding_window=0),
    "layers-million": _config(text_num_hidden_layers=10**6),
    "hidden-size-zero": _config(text_hidden_size=0),
    "heads-zero": _config(text_num_attention_heads=0),
    "top-k-over-experts": _config(text_top_k_experts=9),
    "eos-outside-vocab": _config(text_eos_token_id=[1, 10**6]),
    "rms-eps-negative": _config(text_rms_norm_eps=-1.0),
    "layer-types-length": _config(text_layer_types=["full_attention"]),
    "generation-config-list": _write("generation_config.json", "[]"),
    "dgpipe-json-not-json": _write("dgpipe.json", "{"),
    # the tokenizer, its config and the chat template: bounded and UTF-8
    "tokenizer-huge": _oversize("tokenizer.json"),
    "tokenizer-config-huge": _oversize("tokenizer_config.json"),
    "special-tokens-huge": _oversize("special_tokens_map.json"),
    "chat-template-huge": _oversize("chat_template.jinja"),
    "chat-template-json-huge": _oversize("chat_template.json"),
    "generation-config-huge": _oversize("generation_config.json"),
    "dgpipe-json-huge": _oversize("dgpipe.json"),
    "tokenizer-config-not-utf8": _write("tokenizer_config.json", NOT_UTF8),
    "special-tokens-not-utf8": _write("special_tokens_map.json", b'{"eos_token": "\xc3"}'),
    "chat-template-not-utf8": _write("chat_template.jinja", b"{{ messages }}\xff"),
    "tokenizer-not-utf8": _write("tokenizer.json", b'{"version": "1.0", "x": "\xff"}'),
    "tokenizer-config-list": _write("tokenizer_config.json", "[]"),
    "special-tokens-not-json": _write("special_tokens_map.json", "{eos"),
}
# what only the validator checks (package, quantize, export and build run it; generate loads the model and
# meets these when it builds its sampler and tokenizer, each a one-line error too)
VALIDATOR_CASES: dict[str, Callable[[Path], None]] = {
    "generation-steps-1e9": _generation(max_denoising_steps=1e9),
    "generation-steps-zero": _generation(max_denoising_steps=0),
    "generation-steps-fraction": _generation(max_denoising_steps=2.5),
    "generation-entropy-negative": _generation(
        sampler_config={"entropy_bound": -1, "_cls_name": "EntropyBoundSamplerConfig"}
    ),
    "generation-sampler-no-class": _generation(sampler_config={"entropy_bound": 0.1}),
    "generation-sampler-list": _generation(sampler_config=[0.1]),
    "generation-t-min-over-t-max": _generation(t_min=0.9, t_max=0.5),
    "generation-temperature-zero": _generation(t_max=0),
    "generation-eos-outside-vocab": _generation(eos_token_id=[1, 10**6]),
    "generation-eos-string": _generation(eos_token_id="</s>"),
    "generation-max-new-tokens-zero": _generation(max_new_tokens=0),
    "generation-max-new-tokens-string": _generation(max_new_tokens="82"),
    "tokenizer-garbage": _write("tokenizer.json", '{"model": 7}'),
}
CASES.update(VALIDATOR_CASES)


def _corrupt(tiny: Path, case: str) -> Path:
    CASES[case](tiny)
    return tiny


@pytest.mark.parametrize("case", sorted(CASES))
def test_validator_refuses(tiny_checkpoint: Path, case: str):
    d = _corrupt(tiny_checkpoint, case)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(d, weights=True)
    assert e.value.hint, f"{case}: no fix named in {e.value}"
    assert str(d) in str(e.value), f"{case}: the file is not named in {e.value}"
    if case in VALIDATOR_CASES:
        return
    # load_model (generate, export) refuses it too, before allocating the model
    with pytest.raises(CheckpointError):
        ck.load_model(d)


def test_file_errors_name_the_file_and_the_problem(tiny_checkpoint: Path):
    for case, words in (
        ("tokenizer-huge", "tokenizer.json: larger than 64 MiB, the bound for a tokenizer.json"),
        ("special-tokens-huge", "special_tokens_map.json: larger than 1 MiB"),
        ("tokenizer-config-not-utf8", "tokenizer_config.json: not valid UTF-8 (byte 0xff at offset 19)"),
        ("chat-template-not-utf8", "chat_template.jinja: not valid UTF-8"),
        ("generation-steps-1e9", "max_denoising_steps 1000000000 is over the serving cap of 256"),
        ("generation-entropy-negative", "entropy_bound must be in [0.001, 1e+06] (got -1"),
        ("generation-sampler-no-class", "'sampler_config._cls_name' must be 'EntropyBoundSamplerConfig'"),
        ("generation-eos-outside-vocab", "eos_token_id 1000000 is not a token id"),
        ("generation-max-new-tokens-string", "max_new_tokens '82' is not a positive integer"),
        ("tokenizer-garbage", "tokenizer.json: cannot be read as a tokenizers file"),
    ):
        d = tiny_checkpoint.parent / case
        shutil.copytree(tiny_checkpoint, d)
        CASES[case](d)
        with pytest.raises(CheckpointError) as e:
            validate_checkpoint(d)
        assert words in str(e.value), (case, str(e.value))
        assert "\n" not in str(e.value), (case, str(e.value))


def test_valid_checkpoint_passes(tiny_checkpoint: Path, tmp_path: Path):
    """The corpus is not refusing everything: the untouched checkpoint, a symlink that stays inside, a
    sharded index and the HF cache's snapshots -> blobs links all validate."""
    validate_checkpoint(tiny_checkpoint, weights=True)
    (tiny_checkpoint / "alias.json").symlink_to("config.json")
    _index(lambda m: m)(tiny_checkpoint)
    validate_checkpoint(tiny_checkpoint, weights=True)
    snap = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.is_file() and not f.is_symlink():
            shutil.copyfile(f, blobs / f.name)
            (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    ckpt = validate_checkpoint(snap, weights=True)
    assert ckpt.config.text_config.hidden_size == 32
    assert Path("config.json") in checkpoint_files(snap)


def test_config_limit_errors_name_the_field(tiny_checkpoint: Path):
    good = (tiny_checkpoint / "config.json").read_text()
    for change, words in (
        (
            _config(text_num_hidden_layers=10**6),
            "num_hidden_layers': Input should be less than or equal to 1024",
        ),
        (_config(canvas_length=0), "canvas_length': Input should be greater than or equal to 1"),
        (_config(text_vocab_size=-1), "vocab_size': Input should be greater than or equal to 1"),
        (_write("config.json", "null"), "holds a NoneType, not a JSON object"),
    ):
        (tiny_checkpoint / "config.json").write_text(good)
        change(tiny_checkpoint)
        with pytest.raises(CheckpointError, match=r"config\.json") as e:
            ck.open_checkpoint(tiny_checkpoint)
        assert words in str(e.value) and "fix config.json" in str(e.value)


# ---- the CLI: each command refuses, with one error line and nothing written ---------------------------
CLI_CASES = {
    "generate": [
        "tokenizer-config-not-utf8",
        "chat-template-huge",
        "truncated-tail",
        "nan-weight",
        "symlink-config-dev-zero",
        "vocab-size-negative",
        "layers-million",
    ],
    "package": [
        "pickle-beside-safetensors",
        "symlink-notes-etc-passwd",
        "symlink-tokenizer-dev-zero",
        "nan-weight",
        "missing-tensor",
        "tokenizer-huge",
        "special-tokens-not-utf8",
        "generation-steps-1e9",
    ],
    "quantize": [
        "pickle-only",
        "int32-tensor",
        "extra-unknown-tensor",
        "config-list",
        "index-parent-dir",
        "generation-steps-1e9",
        "generation-entropy-negative",
        "tokenizer-config-huge",
    ],
    "export": [
        "generation-sampler-no-class",
        "chat-template-not-utf8",
        "shape-transposed-embed",
        "inf-weight",
        "canvas-length-zero",
        "index-absolute",
    ],
    "build": [
        "generation-entropy-negative",
        "tokenizer-garbage",
        "truncated-header",
        "pickle-training-args",
        "sliding-window-zero",
        "symlink-weights-outside",
    ],
}


def _argv(command: str, model: Path, out: Path) -> list[str]:
    return {
        "generate": ["generate", "--model", str(model), "--max-tokens", "4", "1 2 3"],
        "package": ["package", "--model", str(model), "--output", str(out)],
        "quantize": ["quantize", "--model", str(model), "--precision", "bf16", "--output", str(out)],
        "export": ["export", "--model", str(model), "--output", str(out)],
        "build": ["build", "--model", str(model), "--precision", "bf16", "--build-dir", str(out)],
    }[command]


@pytest.mark.parametrize(
    ("command", "case"),
    [pytest.param(c, k, id=f"{c}-{k}") for c, cases in CLI_CASES.items() for k in cases],
)
def test_cli_refuses(tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys, command: str, case: str):
    from pipeline.cli import main

    d = _corrupt(tiny_checkpoint, case)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["dgpipe", *_argv(command, d, out)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, (e.value.code, err)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in err, err
    assert "(" in lines[-1] and lines[-1].endswith(")"), f"no fix named: {lines[-1]}"
    assert not out.exists(), f"{command} wrote {out} for {case}"
    assert not list(tmp_path.glob(".out*")), "a temporary output was left behind"


def test_package_copies_regular_files_only(tiny_checkpoint: Path, tmp_path: Path):
    """A link that stays inside the checkpoint is copied as a file, never as a link."""
    from pipeline.serving.repository import copy_checkpoint

    (tiny_checkpoint / "alias.json").symlink_to("config.json")
    copy_checkpoint(tiny_checkpoint, tmp_path / "copy")
    copied = tmp_path / "copy" / "alias.json"
    assert copied.is_file() and not copied.is_symlink()
    assert copied.read_bytes() == (tiny_checkpoint / "config.json").read_bytes()


def test_a_directory_without_config_json_is_not_walked(tmp_path):
    """`--model /usr` walked the whole tree and advised deleting a vim tutorial's `.pt` file as a pickle in
    the checkpoint: a directory without config.json is said to be no checkpoint before anything in it is
    read."""
    from pipeline.errors import CheckpointError
    from pipeline.model.checkpoint import open_checkpoint

    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "weights.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"not a checkpoint \(no config\.json\)") as e:
        open_checkpoint(tmp_path)
    assert "pickle" not in str(e.value)


Q_PROJ = "model.decoder.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("fmt", "edit", "needle"),
    [
        ("fp8", lambda s, q: s.pop(Q_PROJ + ".weight_scale"), "has no 'weight_scale'"),
        ("nvfp4", lambda s, q: s.pop(Q_PROJ + ".input_scale"), "has no 'input_scale'"),
        ("nvfp4", lambda s, q: s.__setitem__(Q_PROJ + ".weight_scale", s[Q_PROJ + ".weight_scale"][:1].clone()), r"has shape \(1, 6\)"),
        ("nvfp4", lambda s, q: s.__setitem__(Q_PROJ + ".weight_scale", s[Q_PROJ + ".weight_scale"].float()), "NVFP4 block scales are F8_E4M3"),
        ("fp8", lambda s, q: s.__setitem__(Q_PROJ + ".weight_scale", s[Q_PROJ + ".weight_scale"].reshape(1).repeat(3)), r"has shape \(3,\)"),
        ("fp8", lambda s, q: q.__setitem__("quantization", {"quant_algo": "NVFP4"}), "is F8_E4M3, which a NVFP4 checkpoint does not store"),
        ("fp8", lambda s, q: q.__setitem__("quantization", ["FP8"]), "'quantization' is not an object"),
        ("fp8", lambda s, q: s.__setitem__(Q_PROJ + ".weight_scale", s[Q_PROJ + ".weight_scale"].to(torch.int32)), "scale 'model.decoder.layers.0.self_attn.q_proj.weight_scale' has dtype I32"),
        ("fp8", lambda s, q: q.__setitem__("quantization", {"quant_algo": None, "kv_cache_quant_algo": "FP8"}), "quantizes only the KV cache"),
    ],
)  # fmt: skip
def test_a_quantized_checkpoints_scales_and_label_are_checked(tmp_path, fmt, edit, needle):
    """A missing FP8 weight_scale read the raw E4M3 codes as weights (off by 448x), a one-row NVFP4 block
    scale was broadcast over every row, fp32 block scales broke the ONNX export, a linear without its input
    scale ran unquantized, FP8 weights under an NVFP4 label took NVFP4 activation quantization, and a damaged
    or KV-only quantization block was a traceback or "quant_algo 'None'": each is named before loading."""
    from safetensors.torch import load_file, save_file

    from pipeline.errors import CheckpointError
    from pipeline.model.checkpoint import load_model
    from tests._utils.quantized import build_quantized_checkpoint

    ckpt = build_quantized_checkpoint(tmp_path / "ckpt", fmt)
    state = load_file(ckpt / "model.safetensors")
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())
    edit(state, hq)
    save_file(state, str(ckpt / "model.safetensors"))
    (ckpt / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match=needle):
        load_model(ckpt)


def _header(dtype: str, *shape: int):
    from pipeline.model.files import TensorHeader

    return TensorHeader(Path("model.safetensors"), dtype, shape)


@pytest.mark.parametrize("shape", [(), (1,), (6,), (6, 1)])
def test_fp8_weight_scales_per_tensor_or_per_output_row_are_accepted(shape):
    """ModelOpt writes an FP8 weight scale per tensor or per output row: each layout loads."""
    from pipeline.model.shapes import check_scales

    headers = {"l.weight_scale": _header("F32", *shape), "l.input_scale": _header("F32")}
    check_scales("l.", "fp8", (6, 32), headers, Path("model.safetensors"))


@pytest.mark.parametrize("shape", [(1, 32), (1, 6), (32,), (6, 32), (6, 2)])
def test_fp8_weight_scales_of_another_layout_are_named(shape):
    """A [1, in] (per input column) or other-shaped FP8 weight scale broadcast over the wrong axis: every
    weight dequantized wrong. The error names the tensor, its shape and the shapes that would load."""
    from pipeline.model.shapes import check_scales

    headers = {"l.weight_scale": _header("F32", *shape), "l.input_scale": _header("F32")}
    with pytest.raises(CheckpointError) as e:
        check_scales("l.", "fp8", (6, 32), headers, Path("model.safetensors"))
    assert str(e.value).startswith(
        f"model.safetensors: 'l.weight_scale' has shape {shape}, a FP8 weight of (6, 32) needs "
        "() or (1,) or (6,) or (6, 1)"
    )


@pytest.mark.parametrize(
    ("groups", "ok"), [(1, True), (4, True), (32, True), (5, False), (64, False), (0, False)]
)
def test_int4_awq_scale_groups_must_divide_the_input_dimension(groups, ok):
    """INT4 AWQ scales one group of input columns per scale: a group count that does not divide the input
    dimension (or none at all) leaves columns without a scale, so it is refused naming the tensor, not
    broadcast into wrong weights or a ZeroDivisionError."""
    from pipeline.model.shapes import check_scales

    headers = {"l.weight_scale": _header("F16", 6, groups)}
    if ok:
        check_scales("l.", "int4_awq", (6, 32), headers, Path("model.safetensors"))
        return
    with pytest.raises(CheckpointError) as e:
        check_scales("l.", "int4_awq", (6, 32), headers, Path("model.safetensors"))
    assert str(e.value).startswith(
        f"model.safetensors: 'l.weight_scale' has shape (6, {groups}), a INT4_AWQ weight of (6, 32) needs (6, -1)"
    )


def test_an_expert_index_equal_to_the_expert_count_is_an_unexpected_tensor(tiny_checkpoint: Path):
    """Experts are numbered 0..num_experts-1: a per-expert tensor for expert num_experts (4 in the tiny model)
    belongs to another config, and the error names that tensor, not a missing one elsewhere."""
    _add("model.decoder.layers.0.experts.4.down_proj.weight", torch.zeros(32, 16))(tiny_checkpoint)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(tiny_checkpoint, weights=True)
    assert "unexpected tensor 'model.decoder.layers.0.experts.4.down_proj.weight'" in str(e.value)
