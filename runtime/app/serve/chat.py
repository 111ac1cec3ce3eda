"""The chat template of a model folder, rendered as transformers renders it (jinja2, sandboxed).

Where it comes from: ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates: the
one named ``default``), else a ``chat_template.jinja`` file, in the model folder (``model.path``) or else the folder
of ``workload.tokenizer``. The template sees ``messages``, ``add_generation_prompt=True``, the special tokens of
tokenizer_config.json (``bos_token``, ``eos_token``, ...), and ``raise_exception``; ``tojson`` is a filter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.app.serve.protocol import ApiError, refuse
from runtime.core.errors import Problem

TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def template_folders(model_path: str | None, tokenizer_path: str | None) -> list[Path]:
    """The folders that may hold tokenizer_config.json, in the order they are tried."""
    out = []
    if model_path:
        out.append(Path(model_path))
    if tokenizer_path:
        p = Path(tokenizer_path)
        out.append(p if p.is_dir() else p.parent)
    return out


class ChatTemplate:
    """Renders chat messages to the prompt text; ``source`` says where the template came from (None: none)."""

    def __init__(self, template: str | None, special: dict[str, str], source: str | None, searched: list[Path]):
        self.template, self.special, self.source, self.searched = template, special, source, searched
        self._compiled = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise ApiError(400, f"the chat template refused the messages: {message}", "messages")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(template)

    @classmethod
    def load(cls, folders: list[Path]) -> ChatTemplate:
        for folder in folders:
            cfg_file = folder / "tokenizer_config.json"
            cfg: dict[str, Any] = {}
            if cfg_file.is_file():
                try:
                    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    cfg = {}
            special = {k: _token_text(cfg.get(k)) for k in TOKEN_KEYS if cfg.get(k) is not None}
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):
                named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
                tpl = named.get("default")
            if isinstance(tpl, str):
                return cls(tpl, special, str(cfg_file), folders)
            jinja = folder / "chat_template.jinja"
            if jinja.is_file():
                return cls(jinja.read_text(encoding="utf-8"), special, str(jinja), folders)
        return cls(None, {}, None, folders)

    def render(self, messages: list[dict]) -> str:
        if self._compiled is None:
            where = ", ".join(str(f) for f in self.searched) or "no model folder (model.path) and no workload.tokenizer"
            raise refuse([Problem("messages", f"a chat request, but the model has no chat_template (looked in: {where})",
                                  "a chat_template in the model folder's tokenizer_config.json",
                                  "add \"chat_template\" to tokenizer_config.json (or a chat_template.jinja file), or use "
                                  "/v1/completions with the prompt already formatted")])
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=True, **self.special)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001  (a template error is the request's or the model's, never fatal)
            raise ApiError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           "messages") from e


def _token_text(v: Any) -> str:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict with ``content``."""
    return v.get("content", "") if isinstance(v, dict) else str(v)
