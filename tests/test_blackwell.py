"""The Blackwell backends (trtllm_mla, tokenspeed_mla) on the CPU, through the torch EMULATION of each kernel's
calling contract (backend.kernel=emulate): every forward mode against the float64 oracle, the kernel contract
seen by a recording fake, speculative decoding, the CLI with parity, and the hardware gate's messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from dependency_injector import providers
from mla_harness import make_harness, oracle_absorbed, random_batch, random_q, rel_err, spec

import containers
from backends.kernels.mla_decode.emulated_mla import (
    EmulatedTokenSpeedMLADecode,
    EmulatedTrtllmMLADecode,
    tokenspeed_workspace_bound,
    tokenspeed_workspace_bytes,
    trtllm_counter_bytes,
)
from backends.tokenspeed_mla import TokenSpeedMLABackend
from backends.trtllm_mla import TrtllmMLABackend
from runtime.app.validation import validate
from runtime.core.batch import ForwardMode
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError
from runtime.core.workspace import WorkspaceLedger
from runtime.engine.graph_runner import decide_graphs

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
H100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "NVIDIA H100 80GB HBM3", 132)
B200 = DeviceInfo("cuda", "cuda", 0, True, (10, 0), "NVIDIA B200", 148)
B300 = DeviceInfo("cuda", "cuda", 0, True, (10, 3), "NVIDIA B300", 148)
SM107 = DeviceInfo("cuda", "cuda", 0, True, (10, 7), "an SM107 GPU", 148)
RTX5090 = DeviceInfo("cuda", "cuda", 0, True, (12, 0), "NVIDIA GeForce RTX 5090", 170)
PAGE = {"trtllm_mla": 32, "tokenspeed_mla": 16}
SMALL_WS = "backend.workspace_bytes=65536"


def emulated(name: str, *overrides: str) -> tuple[str, ...]:
    extra = (SMALL_WS,) if name == "trtllm_mla" else ()
    return (f"backend={name}", "backend.kernel=emulate", f"kv.page_size={PAGE[name]}", "kv.num_pages=160", *extra,
            *overrides)


def _backend(name: str, h, model, sm_count: int = 148):
    ledger = WorkspaceLedger(torch.device("cpu"))
    if name == "trtllm_mla":
        return TrtllmMLABackend(h.req_to_token, h.kv, model, ledger, EmulatedTrtllmMLADecode(sm_count),
                                {"name": name, "workspace_bytes": 1 << 16}, max_batch=16, sm_count=sm_count), ledger
    return TokenSpeedMLABackend(h.req_to_token, h.kv, model, ledger, EmulatedTokenSpeedMLADecode(sm_count),
                                {"name": name}, sm_count=sm_count, max_q_len=4), ledger


# ---------------------------------------------------------------------------------------- every mode
@pytest.mark.parametrize("name", ["trtllm_mla", "tokenspeed_mla"])
@pytest.mark.parametrize("mode,prefix,extend", [
    (ForwardMode.DECODE, [1], [1]),                                   # batch of one, shortest context
    (ForwardMode.DECODE, [63, 31, 32, 7, 100], [1, 1, 1, 1, 1]),      # page boundaries, odd lengths
    (ForwardMode.EXTEND, [0, 0, 5], [7, 1, 63]),                      # empty prefixes, ragged prefill
    (ForwardMode.EXTEND, [64, 33], [32, 17]),                         # prefill over cached prefixes
    (ForwardMode.TARGET_VERIFY, [30, 1, 95], [4, 4, 4]),              # uniform q_len > 1
    (ForwardMode.DRAFT_EXTEND, [16, 47], [4, 4]),
    (ForwardMode.DRAFT_EXTEND, [9], [1]),                             # the draft's bootstrap token
])
def test_every_forward_mode_matches_the_float64_oracle(name, mode, prefix, extend):
    gen = torch.Generator().manual_seed(len(prefix) * 31 + sum(prefix))
    h = make_harness(PAGE[name], num_pages=64, max_context=512, dtype=torch.float64)
    model = spec(heads=4, dtype="float64", max_context=512)
    backend, _ = _backend(name, h, model)
    batch, slots = random_batch(h, prefix, extend, gen, mode=mode)
    q_nope, q_pe = random_q(batch, 4, gen, "cpu", torch.float64)
    backend.init_forward_metadata(batch)
    fwd = backend.forward_decode if mode == ForwardMode.DECODE else backend.forward_extend
    out = fwd(q_nope, q_pe, 0, batch)
    ref = oracle_absorbed(h, batch, slots, q_nope, q_pe, model.sm_scale)
    assert out.shape == ref.shape and out.dtype == torch.float64
    assert rel_err(out, ref) < 1e-12


# ------------------------------------------------------------------------------- the kernel contract
class Recorder:
    """Stands in for the kernel: records every call's arguments (copies of the metadata, taken at call time)
    and delegates to the emulation so the engine keeps producing real tokens."""

    def __init__(self, inner, req_to_token: torch.Tensor):
        self.inner, self.req_to_token, self.calls = inner, req_to_token, []

    def __call__(self, **kw):
        rec = dict(kw)
        for key in ("block_tables", "seq_lens", "cum_seq_lens_q"):
            if kw.get(key) is not None:
                rec[key] = kw[key].clone()
        ws = kw["workspace_buffer"]
        rec["workspace_ptr"], rec["workspace_zero"] = ws.data_ptr(), not bool(ws.any())
        counters = kw.get("multi_ctas_kv_counter_buffer")
        rec["counters_zero"] = counters is None or not bool(counters.any())
        self.calls.append(rec)
        return self.inner(**kw)


def _recorded_run(name: str, *overrides: str):
    container = containers.Container()
    plain = containers.to_plain(compose_config("device=cpu", *emulated(name, "model.dtype=bfloat16", *overrides)))
    container.config.from_dict(plain)
    kernel_provider = container.trtllm_kernel if name == "trtllm_mla" else container.tokenspeed_kernel
    rec = Recorder(kernel_provider(), container.req_to_token_pool().req_to_token)
    kernel_provider.override(providers.Object(rec))
    rt = containers.build(plain, container=container)
    res = rt.engine.run()
    return rt, res, rec


def _check_block_tables(rec: Recorder, page: int) -> int:
    """Every call's block table row b, page k == req_to_token[req_b, k * page] // page for the pages that
    hold its seq_len; returns how many entries were checked."""
    checked = 0
    for c in rec.calls:
        bt, lens = c["block_tables"], c["seq_lens"]
        assert bt.dtype == torch.int32 and bt.dim() == 2 and bt.is_contiguous()
        for b, n in enumerate(lens.tolist()):
            pages = -(-n // page)
            want = (c["table"][b, torch.arange(pages) * page] // page).to(torch.int32)
            assert torch.equal(bt[b, :pages], want)
            checked += pages
    return checked


class RowRecorder(Recorder):
    """Also records the request rows of each call (from the backend's batch), for the block-table check."""

    def __init__(self, inner, req_to_token, rows_of):
        super().__init__(inner, req_to_token)
        self.rows_of = rows_of

    def __call__(self, **kw):
        out = super().__call__(**kw)
        rows = self.rows_of()
        self.calls[-1]["rows"] = rows
        self.calls[-1]["table"] = self.req_to_token[rows].clone()  # the rows as they are now (they get reused)
        return out


def test_trtllm_kernel_contract_seen_by_a_recording_fake():
    rt, res, rec = _recorded_run("trtllm_mla")
    assert res.finished == len(res.outputs) and res.lost == 0
    spec_ = rt.container.model_spec()
    kv = rt.container.kv_pool()
    ledger = rt.container.workspace_ledger()
    backend = rt.container.backend()
    ws, counters = backend.workspace, backend.counters
    specs = ledger.specs()
    assert specs["trtllm_mla_workspace"].zero_init and not specs["trtllm_mla_workspace"].shareable
    assert specs["trtllm_mla_counters"].zero_init and not specs["trtllm_mla_counters"].shareable
    assert ws.numel() == 65536 and counters.numel() == trtllm_counter_bytes(64, spec_.num_heads, 0)
    uniform = [c for c in rec.calls if c["query"].dim() == 4]
    var_q = [c for c in rec.calls if c["query"].dim() == 3]
    # decode steps and uniform batches: [B, q_len, H, 576]; ragged prefill: the compact variable-length query
    assert any(c["query"].shape[1] == 1 for c in uniform) and var_q
    for c in rec.calls:
        q = c["query"]
        assert q.dtype == torch.bfloat16 and q.is_contiguous() and q.shape[-2:] == (spec_.num_heads, 576)
        assert c["out"].dtype == torch.bfloat16 and c["out"].shape == q.shape[:-1] + (512,)
        assert c["kv_cache"].data_ptr() in {b.data_ptr() for b in kv.buffers}
        assert c["kv_cache"].shape[1:] == (32, 576)
        assert c["bmm1_scale"] == spec_.sm_scale and c["bmm2_scale"] == 1.0 and c["backend"] == "trtllm-gen"
        assert (c["qk_nope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"]) == (128, 512, 64)
        assert c["workspace_buffer"] is ws and c["multi_ctas_kv_counter_buffer"] is counters
        assert c["workspace_zero"] and c["counters_zero"]  # zeroed once, still zero on every call
        assert c["seq_lens"].dtype == torch.int32 and c["max_seq_len"] >= int(c["seq_lens"].max())
        assert c["block_tables"].shape[1] % (128 // 32) == 0  # aligned width
    for c in uniform:
        assert c.get("cum_seq_lens_q") is None
    for c in var_q:
        cum = c["cum_seq_lens_q"]
        assert cum.dtype == torch.int32 and int(cum[-1]) == c["query"].shape[0]
        assert c["max_q_len"] == int((cum[1:] - cum[:-1]).max())
    # the workspace is never the shared FlashInfer buffer, which is not even allocated
    assert ledger.report()["flashinfer_float"] == 0


@pytest.mark.parametrize("name", ["trtllm_mla", "tokenspeed_mla"])
def test_block_tables_hold_each_requests_pages(name):
    container = containers.Container()
    plain = containers.to_plain(compose_config("device=cpu", *emulated(name)))
    container.config.from_dict(plain)
    provider = container.trtllm_kernel if name == "trtllm_mla" else container.tokenspeed_kernel
    backend_box = {}
    rec = RowRecorder(provider(), container.req_to_token_pool().req_to_token,
                      lambda: backend_box["batch"].req_pool_indices_cpu.tolist())
    provider.override(providers.Object(rec))
    rt = containers.build(plain, container=container)
    backend = rt.container.backend()
    original = backend.init_forward_metadata

    def remember(batch):
        backend_box["batch"] = batch
        original(batch)

    backend.init_forward_metadata = remember
    res = rt.engine.run()
    assert res.lost == 0 and _check_block_tables(rec, PAGE[name]) > 0


def test_tokenspeed_kernel_contract_and_workspace_sized_from_sms_heads_and_rank():
    rt, res, rec = _recorded_run("tokenspeed_mla")
    assert res.finished == len(res.outputs)
    spec_ = rt.container.model_spec()
    ledger = rt.container.workspace_ledger()
    ws = rt.container.backend().workspace
    assert ws.numel() == tokenspeed_workspace_bound(148, spec_.num_heads, 512, 1)  # CPU: emulated 148 SMs
    assert ledger.report()["flashinfer_float"] == 0
    assert rec.calls and all(c["query"].dim() == 4 and c["query"].shape[1] == 1 for c in rec.calls)  # decode only
    for c in rec.calls:
        assert c["workspace_buffer"].dtype == torch.int8 and c["workspace_buffer"].data_ptr() == ws.data_ptr()
        assert c["softmax_scale"] == spec_.sm_scale and c["output_scale"] == 1.0
        assert c["causal_mask"] and c["is_var_seq"] and c["query"].dtype == torch.bfloat16
        b, q_len, h = c["query"].shape[:3]
        assert tokenspeed_workspace_bytes(b, q_len, h, 512, 148) <= ws.numel()


@pytest.mark.parametrize("heads,max_q", [(1, 1), (4, 1), (16, 1), (16, 4), (16, 8), (32, 5), (64, 4), (128, 1),
                                         (128, 4), (96, 8)])
def test_tokenspeed_workspace_bound_covers_every_batch(heads, max_q):
    bound = tokenspeed_workspace_bound(148, heads, 512, max_q)
    need = max(tokenspeed_workspace_bytes(b, q, heads, 512, 148) for b in range(1, 300) for q in range(1, max_q + 1))
    assert 0 < need <= bound


def test_emulated_counters_must_stay_zero():
    h = make_harness(32, num_pages=16, max_context=256, dtype=torch.bfloat16)
    model = spec(heads=4, dtype="bfloat16", max_context=256)
    backend, _ = _backend("trtllm_mla", h, model)
    batch, _ = random_batch(h, [40], [1], torch.Generator().manual_seed(0))
    q_nope, q_pe = random_q(batch, 4, torch.Generator().manual_seed(1), "cpu", torch.bfloat16)
    backend.init_forward_metadata(batch)
    backend.forward_decode(q_nope, q_pe, 0, batch)
    backend.counters[3] = 1  # something else wrote the semaphores (a shared or non-zeroed buffer)
    with pytest.raises(ValueError, match="non-zero counters"):
        backend.forward_decode(q_nope, q_pe, 0, batch)


# ------------------------------------------------------------------------------ speculative decoding
F64 = ("model.dtype=float64", "workload.num_requests=4")


def _spec_run(name: str, *overrides: str, spec_on: bool = True):
    cfg = compose_config("+deploy=cpu_speculative", *emulated(name, *F64, *overrides),
                         f"speculative.enabled={str(spec_on).lower()}")
    rt = containers.build(cfg)
    return rt, rt.engine.run()


@pytest.mark.parametrize("name", ["trtllm_mla", "tokenspeed_mla"])
def test_speculative_tokens_equal_plain_greedy_and_the_kv_indices_pass_is_skipped(name):
    rt, spec_res = _spec_run(name)
    _, plain = _spec_run(name, spec_on=False)
    assert spec_res.outputs == plain.outputs and spec_res.lost == 0
    stats = rt.container.speculative().stats
    assert stats.rounds > 0
    # every draft step backend builds its own block tables: the shared pass is not built, and each round's
    # draft-step plan counts one skip
    assert rt.container.draft_kv_indices() is None
    assert rt.container.draft_attention().kv_indices_skipped == stats.rounds
    # draft step instances have their own, unshared workspaces in the ledger
    assert any(":draft" in n for n in rt.container.workspace_ledger().consumers())
    # every speculative mode would be graphed on a GPU: the decision comes from capabilities only
    used = [rt.container.backend(), *rt.container.draft_backends()]
    assert all(d.graphed for d in decide_graphs(True, "cuda", used, True, [1, 2, 4]).values())
    assert rt.container.mha_prefill() is None  # no MHA prefill hook: prefill is absorbed
    if name == "trtllm_mla":  # forcing the pass runs it every round and changes no token
        rt_forced, forced = _spec_run(name, "speculative.shared_kv_indices=always")
        assert forced.outputs == spec_res.outputs
        assert rt_forced.container.draft_kv_indices().runs == rt_forced.container.speculative().stats.rounds
        assert rt_forced.container.draft_attention().kv_indices_skipped == 0


# ---------------------------------------------------------------------------------- CLI and report
@pytest.mark.parametrize("name", ["trtllm_mla", "tokenspeed_mla"])
def test_cli_speculative_parity_report_labels_the_emulation(name, tmp_path):
    args = ["+deploy=cpu_speculative", *emulated(name), "workload.num_requests=4", "speculative.baseline=false",
            "progress=false", f"hydra.run.dir={tmp_path}"]
    p = subprocess.run([sys.executable, "-m", "runtime", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "EMULATION" in p.stdout
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["kernel"]["emulated"] is True and "EMULATION" in rep["kernel"]["note"]
    assert rep["parity"]["ok"] is True and rep["parity"]["tokens_equal"] is True
    ws = rep["memory"]["workspaces"]
    assert ws["flashinfer_float"] == 0
    own = "trtllm_mla_workspace" if name == "trtllm_mla" else "tokenspeed_mla_workspace"
    assert ws[own] > 0 and any(k.startswith(own + ":draft") for k in ws)
    kv = rep["speculative"]["shared_kv_indices"]
    assert kv["runs"] == 0 and kv["skipped"] == rep["speculative"]["rounds"] > 0 and not kv["injected"]


def test_importing_the_project_never_imports_the_kernel_packages():
    code = ("import sys, containers, runtime.app.cli\n"
            "assert not {'flashinfer', 'tokenspeed_mla'} & set(sys.modules), sorted(sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


# ------------------------------------------------------------------------------------ hardware gate
def _gate(name: str, device: DeviceInfo, *overrides: str, present=lambda pkg: True) -> str:
    kind = "cpu" if device.kind == "cpu" else "cuda"
    page = () if any(o.startswith("kv.page_size") for o in overrides) else (f"kv.page_size={PAGE[name]}",)
    plain = containers.to_plain(compose_config(f"device={kind}", f"backend={name}", *page, "model.dtype=bfloat16",
                                               *overrides))
    return "\n".join(str(p) for p in validate(plain, containers.BACKENDS, device, package_present=present))


@pytest.mark.parametrize("name,families", [("trtllm_mla", "10.0, 10.3"), ("tokenspeed_mla", "10.0, 10.3, 10.7")])
def test_refused_on_hopper_naming_the_gpu_the_requirement_and_what_runs_there(name, families):
    text = _gate(name, H100)
    assert "GPU NVIDIA H100 80GB HBM3 (compute capability 9.0)" in text
    assert "compute capability >= 10.0" in text and f"exactly one of {families}" in text
    fix = text.split("Fix:")[-1]
    for other in ("flashinfer_mla", "triton_mla", "torch_mla"):  # derived from their capabilities
        assert other in fix, fix
    assert "trtllm_mla," not in fix and "tokenspeed_mla," not in fix and "backend.kernel=emulate" in fix


@pytest.mark.parametrize("name", ["trtllm_mla", "tokenspeed_mla"])
def test_refused_on_the_cpu_with_the_backends_that_run_there(name):
    text = _gate(name, CPU)
    assert "device cpu (no GPU)" in text and "compute capability >= 10.0" in text
    fix = text.split("Fix:")[-1]
    assert "torch_mla" in fix and "flashinfer_mla" not in fix


def test_exact_families_not_just_a_minimum():
    assert _gate("trtllm_mla", B200) == "" and _gate("trtllm_mla", B300) == ""
    assert _gate("tokenspeed_mla", SM107) == ""
    assert "exactly one of 10.0, 10.3" in _gate("trtllm_mla", SM107)
    for name in ("trtllm_mla", "tokenspeed_mla"):
        assert "compute capability 12.0" in _gate(name, RTX5090)


def test_missing_package_points_to_the_blackwell_extra():
    text = _gate("trtllm_mla", B200, present=lambda pkg: False)
    assert "'flashinfer'" in text and "mla-runtime[blackwell]" in text


@pytest.mark.parametrize("device", [CPU, H100])
@pytest.mark.parametrize("name", ["trtllm_mla", "tokenspeed_mla"])
def test_emulate_lifts_the_gate(name, device):
    assert _gate(name, device, "backend.kernel=emulate", present=lambda pkg: False) == ""


def test_refused_before_anything_is_allocated(monkeypatch):
    allocated = []
    monkeypatch.setattr(containers.MLAKVPool, "__init__", lambda *a, **k: allocated.append(1))
    monkeypatch.setattr(WorkspaceLedger, "acquire", lambda *a, **k: allocated.append(2))
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("device=cpu", "backend=trtllm_mla", "kv.page_size=32"))
    assert not allocated and "device cpu (no GPU)" in str(e.value)


def test_kernel_shape_rules_are_refused_with_the_fix():
    text = _gate("trtllm_mla", B200, "model.num_heads=96", "kv.page_size=16")
    assert "num_heads" in text and "kv.page_size=16" in text and "one of [32, 64]" in text
