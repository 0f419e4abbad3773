"""Chat templates are code from the checkpoint: rendering is bounded in time and size, and whatever a
template raises is one `ChatTemplateError` line (issue 33), HTTP 400 in the server and exit status 2
in the CLIs that render chat (`deepinfer-run --chat` and `deepinfer reference --chat` share
`cli_common.prompts_from`; the latter is tested here, on a tiny checkpoint with no compile)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.regions.chat_template import render
from deepinfer.regions.hf_tokenizer import ChatTemplateError, TokenizersTokenizer

from ..conftest import SYNTHETIC_TOKENIZER, with_synthetic_tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}]
FAILING = {
    "zero-division": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "type-error": ("{{ 1 + messages }}", "TypeError"),
    "nested-range": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering took over",
    ),
    "repetition": ("{{ 'a' * 1000000000 }}", "over the limit"),
    "doubling": (
        "{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
        "over the limit",
    ),
    "width": ("{{ '%0999999999d' % 1 }}", "over the limit"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "over the limit"),
    "method-width": ("{{ 'a'.ljust(1000000000) }}", "over the limit"),
    "replace": ("{{ ('a' * 10000000).replace('a', 'aaaaaaaa') }}", "over the limit"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "rendered text"),
}


def tokenizer_with(tmp_path: Path, template: str) -> TokenizersTokenizer:
    shutil.copy(SYNTHETIC_TOKENIZER / "tokenizer.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = TokenizersTokenizer.from_dir(tmp_path)
    tok.render_seconds = 0.5  # the limit is 5 s; a test need not wait it out
    return tok


@pytest.mark.parametrize("name", FAILING)
def test_a_failing_template_is_one_line(tmp_path, name):
    template, words = FAILING[name]
    with pytest.raises(ChatTemplateError) as caught:
        tokenizer_with(tmp_path, template).render_chat(MESSAGES)
    message = str(caught.value)
    assert "\n" not in message and words in message and str(tmp_path) in message


def test_limits_leave_ordinary_templates_alone():
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content | tojson }}{% endfor %}{{ 'x' * 3 }}"
    assert render(template, {"messages": MESSAGES * 3}) == '<|user|>"Hi"' * 3 + "xxx"


def test_a_failing_template_is_exit_status_2(tmp_path):
    """`--chat` through a template that divides by zero: one line on stderr, exit status 2."""
    from deepinfer.cli import main
    from deepinfer.regions.tiny import make_tiny

    ckpt = with_synthetic_tokenizer(make_tiny(tmp_path / "tiny"))
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": FAILING["zero-division"][0]}))
    r = CliRunner().invoke(main, ["reference", str(ckpt), "--chat", "--prompt", "Hi", "--max-new-tokens", "1"])
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and "ZeroDivisionError" in r.output
