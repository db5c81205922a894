"""`engine generate --json-schema FILE | --regex R | --grammar FILE` on a tiny saved model: the
reply follows it, the mask stage is in the --probs JSON, and a bad schema, a missing file or a
grammar with no next token each get one line, never a traceback."""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema
import pytest

from engine.cli.main import main

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_tokenizer):
    from model_folders import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", default_tokenizer)


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def generate(capsys):
    """`python -m engine generate` in this process (what the CLI prints, and its exit status)."""

    def run(folder, *args: str) -> Ran:
        capsys.readouterr()
        code = main(["generate", "--model", str(folder), "--prompt", "Hi", *args])
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


def test_json_schema_with_probs_shows_the_mask_stage(folder, tmp_path, generate):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    proc = generate(folder, "--json-schema", str(schema), "--temperature", "1", "--seed", "3",
                    "--max-new-tokens", "80", "--probs", "3", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), PERSON)
    for token in out["probs"]:
        assert [s["name"] for s in token["stages"]][:2] == ["raw", "grammar"]
        g = token["grammar"]
        assert g["allowed"] == token["stages"][1]["kept_count"] and g["vocab_size"] == 49152
        assert g["removed_mass"] == pytest.approx(1 - token["stages"][1]["kept_mass"], abs=1e-5)
        assert token["id"] not in g["cut_ids"]
    assert out["probs"][0]["grammar"]["forced"]  # '{"' is the only way a JSON object starts


def test_regex_and_lark_and_gbnf_grammars(folder, tmp_path, generate):
    regex = generate(folder, "--regex", "[0-9]{3}", "--temperature", "1", "--seed", "1", "--json")
    assert regex.returncode == 0 and json.loads(regex.stdout)["text"].isdigit()
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= "yes" | "no"')
    answer = generate(folder, "--grammar", str(gbnf), "--json")
    assert answer.returncode == 0 and json.loads(answer.stdout)["text"] in ("yes", "no")
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "maybe" | "never"')
    answer = generate(folder, "--grammar", str(lark), "--json")
    assert json.loads(answer.stdout)["text"] in ("maybe", "never")


@pytest.mark.parametrize(
    ("flag", "text", "words"),
    [
        ("--json-schema", '{"type": "frob"}', "--json-schema: the JSON Schema is invalid"),
        ("--json-schema", '{"type": "string", "format": "nope"}', "cannot be compiled: Unknown format"),
        ("--json-schema", "{not json", "the schema is not valid JSON"),
        ("--grammar", 'start: "a" b', "the Lark grammar cannot be compiled"),
    ],
)
def test_a_bad_schema_or_grammar_is_one_line_before_the_model_loads(
    folder, tmp_path, generate, flag, text, words
):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    proc = generate(folder, flag, str(path))
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr
    assert "ready" not in proc.stderr  # refused before the model was loaded


def test_a_missing_file_and_a_bad_regex_are_one_line(folder, tmp_path, generate):
    missing = generate(folder, "--json-schema", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr
    regex = generate(folder, "--regex", "a(b")
    assert regex.returncode == 2 and "--regex: the regular expression cannot be compiled" in regex.stderr


def test_a_grammar_with_no_next_token_ends_with_its_reason(folder, tmp_path, generate):
    grammar = tmp_path / "dead.lark"
    grammar.write_text('start: "ab" /[b&&c]/')
    proc = generate(folder, "--grammar", str(grammar), "--max-new-tokens", "10")
    assert proc.returncode == 0 and proc.stdout.startswith("ab")
    assert "grammar: the grammar permits no next token" in proc.stderr and "Traceback" not in proc.stderr
