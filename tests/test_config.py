"""Every option of every config group composes, and bad overrides fail at compose time with clear messages."""

from __future__ import annotations

import pytest
from conftest import CONF_DIR, compose_config
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from runtime.core.config import BACKEND_SCHEMAS

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "deploy")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF_DIR / g).glob("*.yaml"))]
DEPLOYS = sorted(f.stem for f in (CONF_DIR / "deploy").glob("*.yaml"))


def test_every_group_of_the_issue_exists():
    assert set(GROUPS) >= {"backend", "model", "workspace", "hisparse", "speculative", "graph", "workload", "device"}


def test_defaults():
    cfg = compose_config()
    assert (cfg.backend.name, cfg.model.name, cfg.device.kind.value, cfg.workload.name) == (
        "torch_mla", "tiny_mla", "auto", "smoke")
    assert not cfg.hisparse.enabled and not cfg.speculative.enabled
    assert cfg.workspace.flashinfer_bytes == 128 << 20 and cfg.workspace.skip is False


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_composes(group, option):
    cfg = compose_config(f"{group}={option}")
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert plain[group]


@pytest.mark.parametrize("deploy", DEPLOYS)
def test_every_deploy_preset_composes(deploy):
    cfg = compose_config(f"+deploy={deploy}")
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_backend_options_match_schemas():
    assert {f.stem for f in (CONF_DIR / "backend").glob("*.yaml")} == set(BACKEND_SCHEMAS)


def test_model_shapes():
    v3, tp8 = compose_config("model=deepseek_v3").model, compose_config("model=deepseek_v3_tp8").model
    assert (v3.num_heads, tp8.num_heads, v3.kv_lora_rank, v3.qk_rope_head_dim, v3.q_lora_rank) == (128, 16, 512, 64, 1536)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException) as e:
        compose_config("backend=flashinfer_mlaa")
    assert "flashinfer_mla" in str(e.value) and "torch_mla" in str(e.value)


@pytest.mark.parametrize("override,fragment", [
    ("workload.num_requests=abc", "num_requests"),
    ("kv.page_size=1.5", "page_size"),
    ("hisparse.enabled=maybe", "enabled"),
    ("model.dtype=float8", "dtype"),
    ("device.kind=tpu", "kind"),
])
def test_wrong_type_fails_at_compose(override, fragment):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_config(override)
    assert fragment in str(e.value) or fragment in str(e.value.__cause__)


def test_typo_in_a_key_fails_at_compose():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as e:
        compose_config("backend.max_splitz=4")
    assert "max_splitz" in str(e.value) or "max_splitz" in str(e.value.__cause__)


def test_backend_specific_key_on_another_backend_fails():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_config("backend=torch_mla", "backend.max_splits=4")
