"""`engine score --text FILE --json` on a tiny saved model: each token's log-probability, rank and
top candidates as the engine's scoring computes them, and the perplexity; a missing file, an empty
text and a text longer than the context refused in one line (exit 2), never a traceback."""

import json
import math

import pytest

from engine.cli.main import main

TEXT = "The sky is blue because of Rayleigh scattering."


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_tokenizer):
    from model_folders import save_tiny_model

    # a 32-token context, so that a long text is refused
    return str(
        save_tiny_model(tmp_path_factory.mktemp("tiny"), default_tokenizer, max_position_embeddings=32)
    )


def test_score_json_is_the_engines_scoring_of_the_text(folder, tmp_path, capsys):
    from engine.config import EngineConfig, ModelSpec
    from engine.core.llm_engine import LLMEngine
    from engine.core.scoring import score_text
    from engine.model.loading import load_model

    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert main(["score", "--model", folder, "--text", str(path), "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = ModelSpec(folder)
    want = score_text(LLMEngine(load_model(spec), EngineConfig(model=spec)), TEXT, 2)
    assert [t["id"] for t in out["tokens"]] == [t.token_id for t in want.tokens]
    assert out["tokens"][0]["logprob"] is None and out["tokens"][0]["top"] is None
    assert [t["logprob"] for t in out["tokens"][1:]] == pytest.approx(
        [t.logprob for t in want.tokens[1:]], abs=1e-6
    )
    assert [t["rank"] for t in out["tokens"]] == [t.rank for t in want.tokens]
    assert all(len(t["top"]) == 2 for t in out["tokens"][1:])
    assert out["scored"] == len(want.tokens) - 1
    assert out["perplexity"] == pytest.approx(math.exp(-out["total_logprob"] / out["scored"]))
    second = out["tokens"][1]
    assert second["surprise_bits"] == pytest.approx(-second["logprob"] / math.log(2))


def test_the_table_ends_with_the_perplexity(folder, tmp_path, capsys):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert main(["score", "--model", folder, "--text", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["token", "logprob", "rank", "surprise"]
    assert lines[-1].startswith("perplexity ")


def test_bad_texts_are_refused_in_one_line(folder, tmp_path, capsys):
    assert main(["score", "--model", folder, "--text", str(tmp_path / "absent.txt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: no text file at {tmp_path / 'absent.txt'}"
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    assert main(["score", "--model", folder, "--text", str(latin)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {latin} is not UTF-8 text"
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    assert main(["score", "--model", folder, "--text", str(empty)]) == 2
    assert capsys.readouterr().err.strip().endswith("error: there is no text to score")
    long = tmp_path / "long.txt"
    long.write_text("word " * 60, encoding="utf-8")
    assert main(["score", "--model", folder, "--text", str(long)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: The text is ") and "but the model's context holds 32" in err
