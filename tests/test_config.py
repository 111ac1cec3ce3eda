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


# ------------------------------------------------------------------ switches (on / off / auto) take true / false
@pytest.mark.parametrize("override,key,name", [
    ("engine.overlap=true", "engine.overlap", "on"),
    ("engine.overlap=false", "engine.overlap", "off"),
    ("engine.overlap=True", "engine.overlap", "on"),
    ("engine.overlap=on", "engine.overlap", "on"),
    ("engine.overlap=off", "engine.overlap", "off"),
    ("engine.overlap=auto", "engine.overlap", "auto"),
    ("model.fused=false", "model.fused", "off"),
    ("model.fused=true", "model.fused", "on"),
    ("model.fused=auto", "model.fused", "auto"),
    ("check=false", "check", "off"),
    ("check=unquantized", "check", "unquantized"),
])
def test_a_switch_takes_true_and_false(override, key, name):
    cfg = compose_config(override)
    assert OmegaConf.select(cfg, key).name == name
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
    group, _, field = key.rpartition(".")
    assert (plain[group] if group else plain)[field] == name


@pytest.mark.parametrize("override,valid", [
    ("engine.overlap=maybe", "[auto, on, off]"),
    ("engine.overlap=1", "[auto, on, off]"),
    ("model.fused=yes", "[auto, on, off]"),
    ("check=true", "[off, reference, unquantized]"),  # check has no 'on'
])
def test_a_bad_switch_value_fails_at_compose_with_the_valid_list(override, valid):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_config(override)
    text = f"{e.value} {e.value.__cause__}"
    assert valid in text and override.split("=")[0].rpartition(".")[2] in text, text


def test_switches_in_yaml_read_booleans(tmp_path):
    """YAML (1.1, as OmegaConf reads it) turns a bare on / off / true / false into a boolean: each still composes."""
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "switches.yaml").write_text(
        "# @package _global_\nengine:\n  overlap: off\nmodel:\n  fused: true\ncheck: false\n")
    cfg = compose_config(f"hydra.searchpath=[file://{tmp_path}]", "+extra=switches")
    assert (cfg.engine.overlap.name, cfg.model.fused.name, cfg.check.name) == ("off", "on", "off")


def test_a_switch_given_true_reaches_the_container():
    import containers

    rt = containers.build(compose_config("device=cpu", "check=false", "engine.overlap=true", "model.fused=false"))
    assert rt.config["engine"]["overlap"] == "on" and rt.engine.overlap is True
    assert rt.config["model"]["fused"] == "off" and rt.config["check"] == "off"
