"""A release's tokenizer: `tokenizer.json` through the `tokenizers` library, with
`tokenizer_config.json` (special tokens, bos/eos, the chat template).

Encoding follows transformers' fast tokenizers: where `tokenizer_config.json` sets
`add_bos_token` or `add_eos_token`, those flags decide what surrounds a text (bos
before, eos after); otherwise `tokenizer.json`'s own post-processor does. Decoding
drops special tokens.

The chat template (`chat_template` in `tokenizer_config.json`, a string or the
"default" of a list of named templates, else a `chat_template.jinja` file) renders
in a sandboxed Jinja2 environment as transformers' `apply_chat_template` does:
`trim_blocks` and `lstrip_blocks`, the loop-control extension, `raise_exception`,
`strftime_now` and a `tojson` filter, with `messages`, `add_generation_prompt`,
`tools` (None, or the functions a model may call) and every special token of the
config (`bos_token`, `eos_token`, ...) in scope.
A template is code from the checkpoint: the sandbox keeps it from reaching
Python objects beyond what it is given.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from deepinfer.errors import ConfigError
from deepinfer.reader import CAP_TOKENIZER, MIB, load_json, read_bytes
from deepinfer.regions.tokenizer import CHAT_TEMPLATE_FILE as TEMPLATE_FILE
from deepinfer.regions.tokenizer import TOKENIZER_CONFIG_FILE as CONFIG_FILE
from deepinfer.regions.tokenizer import TOKENIZER_FILE, Tokenizer

CAP_CONFIG = 16 * MIB  # tokenizer_config.json (added tokens, chat templates), chat_template.jinja
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ConfigError):
    """A chat template failed to render (its own `raise_exception`, or an error in it)."""


def read_tokenizer(path: Path, *, root: Path | None = None):
    """A `tokenizers.Tokenizer` from `path` (ConfigError naming the file when it cannot be read): a
    regular file (inside `root` when given) under `CAP_TOKENIZER`, read once, parsed from those bytes."""
    from tokenizers import Tokenizer as Backend

    text = _text(path, CAP_TOKENIZER, root)
    try:
        return Backend.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for any parse error
        raise ConfigError(
            f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0] if str(e) else e!r})"
        ) from None


def _text(path: Path, cap: int, root: Path | None) -> str:
    data = read_bytes(path, cap, root=root, error=ConfigError)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: is not valid UTF-8 (byte {e.start})") from None


def _token_text(value, source: Path, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(f"{source}: {key}: expected a token string or an object with a 'content' string, got {value!r}")


class TokenizersTokenizer(Tokenizer):
    kind = "tokenizers"

    def __init__(self, backend, config: dict, template: str | None, source: Path):
        self.backend, self.template, self.source = backend, template, source
        where = source / CONFIG_FILE
        self.special = {}  # "bos_token" -> its text
        for key in SPECIAL_KEYS:
            text = _token_text(config.get(key), where, key)
            if text is not None:
                if backend.token_to_id(text) is None:
                    raise ConfigError(f"{where}: {key}: {text!r} is not a token of {source / TOKENIZER_FILE}")
                self.special[key] = text
        self.bos, self.eos, self.pad = (self._id(k) for k in ("bos_token", "eos_token", "pad_token"))
        self.explicit = "add_bos_token" in config or "add_eos_token" in config
        self.add_bos, self.add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
        for wanted, key in ((self.add_bos, "bos_token"), (self.add_eos, "eos_token")):
            if wanted and key not in self.special:
                raise ConfigError(f"{where}: add_{key} is true but {key} is not set")

    def _id(self, key: str) -> int | None:
        text = self.special.get(key)
        return None if text is None else self.backend.token_to_id(text)

    @classmethod
    def from_dir(cls, directory: str | Path, *, root: Path | None = None) -> TokenizersTokenizer:
        """`tokenizer.json`, `tokenizer_config.json` (optional) and `chat_template.jinja` (optional) of
        `directory`; with `root` (a bundle), each must be a regular file inside it, links included."""
        directory = Path(directory)
        backend = read_tokenizer(directory / TOKENIZER_FILE, root=root)
        config = {}
        path = directory / CONFIG_FILE
        if path.exists() or path.is_symlink():
            config = load_json(path, CAP_CONFIG, root=root, error=ConfigError)
            if not isinstance(config, dict):
                raise ConfigError(f"{path}: expected a JSON object at the top level")
        template = _template(config.get("chat_template"), path)
        jinja = directory / TEMPLATE_FILE
        if template is None and (jinja.exists() or jinja.is_symlink()):
            template = _text(jinja, CAP_CONFIG, root)
        return cls(backend, config, template, directory)

    def encode_text(self, text: str, bos: bool) -> list[int]:
        if not self.explicit:  # tokenizer.json's post-processor adds what it adds
            return self.backend.encode(text, add_special_tokens=bos).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if bos:
            first = [self.bos] if self.add_bos and self.bos is not None else []  # set when add_bos (checked above)
            last = [self.eos] if self.add_eos and self.eos is not None else []
            ids = first + ids + last
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def takes_tools(self) -> bool:
        if self.template is None:
            return False
        from jinja2 import TemplateError, meta

        try:
            return "tools" in meta.find_undeclared_variables(_environment().parse(self.template))
        except TemplateError:
            return False  # rendering names the error

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        if self.template is None:
            return super().render_chat(messages, add_generation_prompt, tools)
        from jinja2 import TemplateError

        try:
            compiled = _environment().from_string(self.template)
            return compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **self.special
            )
        except TemplateError as e:
            raise ChatTemplateError(f"{self.source}: chat template: {e}") from None


def _template(value, source: Path) -> str | None:
    """The chat template a tokenizer_config.json value holds (a string, or named templates)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConfigError(
        f'{source}: chat_template: expected a template string or a list of {{"name", "template"}} with a "default"'
    )


def _environment():
    """The sandboxed Jinja2 environment chat templates render in (transformers' settings)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
