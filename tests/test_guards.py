"""Tests of dspine.guards: unvalidated settings are refused at start (spec section 8).

Each refusal is one GuardError (a ValueError) whose message names the setting, the
value given and the accepted values; the CLI turns it into exit code 2 with that line.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dspine.config import DSpineConfig
from dspine.guards import (MAX_CONCURRENCY, VALIDATED, GuardError, check_block_size, check_concurrency,
                           check_device, check_dtype, check_recurrent_state_dtype, check_target_head,
                           validate_runtime)
from dspine.target.adapter import load_target

DOC = Path(__file__).resolve().parents[1] / "docs" / "validated.md"


@pytest.fixture(scope="module")
def tgt():
    return load_target("random:llama", vocab_size=64, seed=0)


@pytest.fixture
def cfg(tgt):
    return DSpineConfig.for_target(tgt)


def test_a_guard_refusal_is_a_clean_cli_error(capsys):
    """A GuardError reaches the user as one line naming the setting, exit status 2 (no traceback)."""
    from dspine.cli.main import main

    assert main(["generate", "hi", "--dtype", "float16", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "not validated" in err and "Traceback" not in err


def test_valid_configuration_passes(tgt, cfg):
    for dt in ("float32", "bfloat16", torch.float32, torch.bfloat16):
        validate_runtime(tgt, cfg, dtype=dt, device="cpu", concurrency=MAX_CONCURRENCY, block_size=16,
                         state_dtype=torch.float32, verify_policy="cost")
    validate_runtime(tgt, None, dtype="float32")  # ar mode
    validate_runtime(None, None, dtype="bfloat16", device="cpu")  # settings only, before loading


@pytest.mark.parametrize("dtype", ["float16", torch.float16, torch.float64, "float8_e4m3fn", "int8"])
def test_drafter_dtype_refused(dtype, tgt, cfg):
    with pytest.raises(GuardError, match=r"SpeculativeConfig.dtype .*not validated; accepted: float32, bfloat16"):
        validate_runtime(tgt, cfg, dtype=dtype)
    with pytest.raises(GuardError, match="accepted: float32, bfloat16"):
        check_dtype(dtype)


@pytest.mark.parametrize("device", ["mps", "xla", "meta", "tpu0", "cpux"])
def test_device_refused(device):
    with pytest.raises(GuardError, match=r"SpeculativeConfig.device .*accepted: cpu, cuda"):
        validate_runtime(None, None, device=device)


def test_cuda_refused_when_unavailable():
    if torch.cuda.is_available():
        check_device("cuda")
        check_device("cuda:0")
        return
    with pytest.raises(GuardError, match="SpeculativeConfig.device 'cuda': CUDA is not available"):
        check_device("cuda")


@pytest.mark.parametrize("c", [0, -1, MAX_CONCURRENCY + 1, 64, 2.0, True])
def test_concurrency_refused(c):
    with pytest.raises(GuardError, match=rf"concurrency .* not validated; accepted: 1..{MAX_CONCURRENCY}"):
        check_concurrency(c)


def test_concurrency_accepted():
    for c in range(1, MAX_CONCURRENCY + 1):
        check_concurrency(c)


def test_block_size_must_match_checkpoint(cfg):
    check_block_size(cfg.block_size, cfg)
    check_block_size(None, cfg)
    with pytest.raises(GuardError, match=r"SpeculativeConfig.block_size 8 differs from the drafter's block size 16; accepted: 16"):
        validate_runtime(None, cfg, block_size=8)


@pytest.mark.parametrize("dt", [torch.bfloat16, "float16", "bfloat16"])
def test_recurrent_state_dtype_refused(dt, tgt, cfg):
    check_recurrent_state_dtype(torch.float32)
    check_recurrent_state_dtype(None)
    with pytest.raises(GuardError, match=r"recurrent state dtype \w+ is not validated; accepted: float32"):
        validate_runtime(tgt, cfg, state_dtype=dt)


def test_recurrent_state_dtype_from_target_config(tgt, cfg):
    tgt.model.config.mamba_ssm_dtype = "bfloat16"
    try:
        with pytest.raises(GuardError, match="mamba_ssm_dtype=bfloat16.*accepted: float32"):
            validate_runtime(tgt, cfg)
    finally:
        del tgt.model.config.mamba_ssm_dtype
    validate_runtime(tgt, cfg)


class _QuantLinear(nn.Linear):
    """Stands for a quantized linear module (bitsandbytes, GPTQ, ...)."""


def _swap_head(target, new_head):
    old = target.model.lm_head
    target.model.lm_head = new_head
    return old


@pytest.mark.parametrize("kind", ["int8", "fp8", "module", "noncontig", "qconfig"])
def test_quantized_target_head_refused_with_final_stage(kind, tgt, cfg):
    old = tgt.model.lm_head
    V, d = old.weight.shape
    try:
        if kind == "int8":
            h = nn.Linear(d, V, bias=False)
            h.weight = nn.Parameter(torch.zeros(V, d, dtype=torch.int8), requires_grad=False)
            _swap_head(tgt, h)
        elif kind == "fp8":
            h = nn.Linear(d, V, bias=False)
            h.weight = nn.Parameter(old.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
            _swap_head(tgt, h)
        elif kind == "module":
            _swap_head(tgt, _QuantLinear(d, V, bias=False))
        elif kind == "noncontig":
            h = nn.Linear(d, V, bias=False)
            h.weight = nn.Parameter(torch.zeros(d, V).T, requires_grad=False)
            _swap_head(tgt, h)
        else:
            tgt.model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
        assert cfg.final_stage
        with pytest.raises(GuardError, match=r"target output head .*final stage.*unquantized contiguous "
                                             r"float32/bfloat16 head"):
            validate_runtime(tgt, cfg)
        with pytest.raises(GuardError, match="continuous logits"):
            check_target_head(tgt, final_stage=False)
    finally:
        tgt.model.lm_head = old
        if kind == "qconfig":
            del tgt.model.config.quantization_config
    validate_runtime(tgt, cfg)


def test_quantization_config_that_skips_lm_head_passes(tgt, cfg):
    tgt.model.config.quantization_config = {"quant_method": "bitsandbytes", "llm_int8_skip_modules": ["lm_head"]}
    try:
        validate_runtime(tgt, cfg)
    finally:
        del tgt.model.config.quantization_config


def test_parallelism_kv_dtype_disaggregation_refused():
    with pytest.raises(GuardError, match="tensor parallel size 2 is not validated; accepted: 1"):
        validate_runtime(tensor_parallel=2)
    with pytest.raises(GuardError, match="pipeline parallel size 4 is not validated; accepted: 1"):
        validate_runtime(pipeline_parallel=4)
    with pytest.raises(GuardError, match="KV cache dtype 'fp4' is not validated; accepted: auto"):
        validate_runtime(kv_cache_dtype="fp4")
    with pytest.raises(GuardError, match="disaggregation is not validated; accepted: off"):
        validate_runtime(disaggregated=True)


def test_target_dtype_refused(cfg):
    t16 = load_target("random:llama", vocab_size=64, seed=0, dtype="float16")
    with pytest.raises(GuardError, match="target dtype float16 is not validated; accepted: float32, bfloat16"):
        validate_runtime(t16, None)


@pytest.mark.parametrize("argv,msg", [
    (["--dtype", "float16"], "--dtype float16: drafter dtype float16 is not validated; accepted: float32, bfloat16"),
    (["--device", "mps"], "--device 'mps' is not validated; accepted: cpu, cuda"),
    (["--verify-policy", "peek"], "--verify-policy 'peek' is unknown; accepted: fixed, cost"),
])
def test_cli_refuses_at_start(argv, msg, capsys):
    from dspine.cli.main import main

    rc = main(["generate", "hi", "--target", "random:llama", "--drafter", "random", "--max-new-tokens", "2"] + argv)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dspine: error: {msg}" and "\n" not in err


def test_validated_doc_lists_every_setting():
    text = DOC.read_text()
    for setting, accepted, _ in VALIDATED:
        row = [l for l in text.splitlines() if l.startswith(f"| {setting} |")]
        assert row, f"docs/validated.md misses {setting!r}"
        assert accepted in row[0]
    assert re.search(r"validate_runtime", text)


@pytest.mark.parametrize("field,value,needle", [
    ("rope_theta", "abc", "rope_theta must be a number"), ("rope_theta", None, "rope_theta must be a number"),
    ("rms_eps", "abc", "rms_eps must be a number"), ("rms_eps", 0.0, "rms_eps must be positive"),
    ("feature_layers", 5, "feature_layers must be a list"), ("bridge", "no", "bridge must be true or false"),
    ("num_layers", True, "num_layers must be a positive int"), ("mode", 3, "mode must be a string"),
])
def test_a_damaged_drafter_config_names_the_field(field, value, needle):
    """A config.json edited by hand (or damaged) is refused naming the field, never a raw
    TypeError deep in the model; the shipped values pass (the negative control)."""
    from dspine.config import ConfigError

    good = DSpineConfig().__dict__.copy()
    assert DSpineConfig.from_dict(good) == DSpineConfig()
    with pytest.raises(ConfigError, match=re.escape(needle)):
        DSpineConfig.from_dict({**good, field: value})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        DSpineConfig.from_dict([])
