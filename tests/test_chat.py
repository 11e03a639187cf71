"""Chat templates (rlkernel/data/chat.py, `rlk run --apply-chat-template`).

Properties:
  - render(prompt) == transformers' tokenizer.apply_chat_template([user prompt], tokenize=False,
    add_generation_prompt=True), string for string, for the stand-in ChatML template and for a
    Qwen-style template using system-message branches, loop controls, raise_exception and tojson;
  - chat_template.jinja wins over tokenizer_config.json; a missing template, a list without
    "default", a template that does not render: ChatTemplateError naming the directory/file;
  - a run with --apply-chat-template encodes render(prompt) (and the reward still sees the raw
    prompt); without a template it is exit 2 before any work, nothing on disk.
Run: `.venv/bin/python -m pytest -q tests/test_chat.py`.
"""

from __future__ import annotations

import json

import pytest

from rlkernel.cli import main
from rlkernel.data.chat import ChatTemplateError, load_chat_template
from rlkernel.data.tokenizer import CHATML_TEMPLATE, standin_tokenizer_files

QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content']"
    " + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "  {%- if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}\n"
    "  {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{{- '<think>' ~ ({'n': 'é'} | tojson) ~ '</think>' }}{%- endif %}")


def _model_dir(tmp_path, template: str | None, *, jinja_file: str | None = None):
    """A tokenizer-only directory: the Qwen3-vocab stand-in tokenizer + the given template."""
    d = tmp_path / "tok"
    d.mkdir()
    files = standin_tokenizer_files(151936, 151645)
    cfg = json.loads(files["tokenizer_config.json"])
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    files["tokenizer_config.json"] = json.dumps(cfg).encode()
    for name, data in files.items():
        (d / name).write_bytes(data)
    if jinja_file is not None:
        (d / "chat_template.jinja").write_text(jinja_file)
    return d


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, QWEN_STYLE], ids=["chatml", "qwen-style"])
@pytest.mark.parametrize("prompt", ["Compute 3+4=", "  héllo\n{{ not jinja }}  "])
def test_render_equals_transformers_apply_chat_template(tmp_path, template, prompt):
    transformers = pytest.importorskip("transformers")
    d = _model_dir(tmp_path, template)
    ref = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert load_chat_template(d).render(prompt) == ref


def test_jinja_file_wins_and_named_templates(tmp_path):
    d = _model_dir(tmp_path, "config {{ messages[0]['content'] }}", jinja_file="file {{ "
                   "messages[0]['content'] }}")
    assert load_chat_template(d).render("x") == "file x"
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "t"},
                            {"name": "default", "template": "d {{ add_generation_prompt }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(d).render("x") == "d True"
    cfg["chat_template"] = [{"name": "tool_use", "template": "t"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        load_chat_template(d)


def test_a_tokenizer_config_giving_chat_template_twice_is_refused(tmp_path):
    """tokenizer_config.json with two "chat_template" values: ChatTemplateError naming the file
    and the key (json took the last one silently, and which one decided the prompts the run
    trained on; found by a breaker). Control: the file with one value loads."""
    d = _model_dir(tmp_path, "one {{ messages[0]['content'] }}")
    text = (d / "tokenizer_config.json").read_text()
    assert load_chat_template(d).render("x") == "one x"
    i = text.index('"chat_template"')
    (d / "tokenizer_config.json").write_text(text[:i] + '"chat_template": "two", ' + text[i:])
    with pytest.raises(ChatTemplateError) as e:
        load_chat_template(d)
    assert "tokenizer_config.json: cannot be read as JSON (duplicate key \"chat_template\" in " \
        "one object)" in str(e.value), str(e.value)


def test_missing_and_broken_templates_name_the_place(tmp_path):
    with pytest.raises(ChatTemplateError, match="embedded tiny model has no chat template"):
        load_chat_template(None)
    d = _model_dir(tmp_path, None)
    with pytest.raises(ChatTemplateError) as e:
        load_chat_template(d)
    assert str(d) in str(e.value) and "chat_template.jinja" in str(e.value)
    (d / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="chat_template.jinja: the chat template does "
                                                "not render"):
        load_chat_template(d).render("x")
    (d / "chat_template.jinja").write_text("{{ raise_exception('no system prompt') }}")
    with pytest.raises(ChatTemplateError, match="no system prompt"):
        load_chat_template(d).render("x")


def _tiny_with_template(tmp_path):
    model = tmp_path / "model"
    assert main(["init-model", "--preset", "tiny", "--seed", "0", "--out", str(model)]) == 0
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "Q: {{ messages[0]['content'] }}\nA:"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model


def test_run_encodes_the_rendered_prompt(tmp_path, monkeypatch):
    """--apply-chat-template: the rollout's prompt ids == tokenizer(render(prompt)), and the
    reward gets the raw prompt text."""
    import rlkernel.runner.loop as loop

    model = _tiny_with_template(tmp_path)
    seen = {}
    real = loop._encode_all

    def spy(cfg, source, tok, chat=None, max_positions=None):
        out = real(cfg, source, tok, chat, max_positions)
        seen["ids"], seen["texts"] = out[0][0], [p.text for p in source.batch(0)]
        seen["tok"] = tok
        return out

    monkeypatch.setattr(loop, "_encode_all", spy)
    d = tmp_path / "run"
    assert main(["run", "--model", str(model), "--apply-chat-template", "--steps", "1",
                 "--n-prompts", "1", "--n-samples-per-prompt", "2", "--max-response-len", "4",
                 "--allow-dirty", "--run-dir", str(d)]) == 0
    text = seen["texts"][0]
    assert seen["ids"] == seen["tok"].encode(f"Q: {text}\nA:")
    assert json.loads((d / "evidence.json").read_text())["complete"] is True


@pytest.mark.parametrize("with_model", [False, True])
def test_no_template_is_exit_2_before_any_work(tmp_path, capsys, with_model):
    args = ["run", "--apply-chat-template", "--allow-dirty", "--run-dir", str(tmp_path / "run")]
    if with_model:
        model = tmp_path / "model"
        assert main(["init-model", "--preset", "tiny", "--seed", "0", "--out", str(model)]) == 0
        args += ["--model", str(model)]
        capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--apply-chat-template" in err[0] and "no chat" in err[0] \
        and "template" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit", ["jinja", "config"])
def test_resume_refuses_an_edited_chat_template(tmp_path, capsys, edit):
    """The template decides the prompt tokens: a resume after chat_template.jinja appears or
    tokenizer_config.json's template changes is exit 2 naming the file; the evidence is kept."""
    model = _tiny_with_template(tmp_path)
    d = tmp_path / "run"
    assert main(["run", "--model", str(model), "--apply-chat-template", "--steps", "1",
                 "--save-every", "1", "--n-prompts", "1", "--n-samples-per-prompt", "2",
                 "--max-response-len", "4", "--allow-dirty", "--run-dir", str(d)]) == 0
    if edit == "jinja":
        (model / "chat_template.jinja").write_text("U: {{ messages[0]['content'] }}\nB:")
        says = "chat_template.jinja (added)"
    else:
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "U: {{ messages[0]['content'] }}\nB:"
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
        says = "tokenizer_config.json (changed)"
    capsys.readouterr()
    assert main(["run", "--resume", str(d), "--steps", "2", "--allow-dirty"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume: tokenizer files" in err[0] and says in err[0], err
    assert len(json.loads((d / "evidence.json").read_text())["steps"]) == 1
