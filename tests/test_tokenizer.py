"""Character and GPT-2 BPE tokenizers: round trips, errors, and serialisation to a dict."""

import pytest

from eqx_gpt import CharTokenizer, GPT2Tokenizer, TokenizerError, pad_vocab, tokenizer_from_dict

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"


def test_char_tokenizer_round_trips_and_sorts_its_vocabulary():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.chars == "".join(sorted(set(TEXT)))
    assert tok.vocab_size == len(set(TEXT))
    ids = tok.encode(TEXT)
    assert ids[:2] == [tok.chars.index("F"), tok.chars.index("i")]
    assert tok.decode(ids) == TEXT
    assert tokenizer_from_dict(tok.to_dict()) == tok


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer.from_text(TEXT)
    with pytest.raises(ValueError, match="does not know: 'ß', 'é'"):
        tok.encode("hé ßé")
    with pytest.raises(TokenizerError, match="outside the character vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="distinct"):
        CharTokenizer("aa")


def test_tokenizer_from_dict_rejects_unknown_kinds():
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        tokenizer_from_dict({"kind": "sentencepiece"})


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    """The GPT-2 tokenizer if tiktoken can get its files (TIKTOKEN_CACHE_DIR or its own cache); else skip."""
    try:
        return GPT2Tokenizer()
    except TokenizerError as error:
        pytest.skip(
            f"GPT-2 BPE files unavailable (set TIKTOKEN_CACHE_DIR to ../shared/data/tiktoken-cache): {error}"
        )


def test_gpt2_tokenizer_round_trips(gpt2_tokenizer):
    tok = gpt2_tokenizer
    assert tok.vocab_size == 50257 and pad_vocab(tok.vocab_size) == 50304
    assert tok.encode("Hello world") == [15496, 995]
    for text in (TEXT, "naïve café — ünïcödé ✓", "<|endoftext|> is plain text here"):
        assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode("<|endoftext|>")) < 50256  # never the special id
    assert tokenizer_from_dict(tok.to_dict()) == tok
    with pytest.raises(TokenizerError, match="outside the GPT-2 vocabulary"):
        tok.decode([50300])


def test_gpt2_tokenizer_reports_missing_files_in_one_line(monkeypatch):
    import tiktoken

    def unavailable(name):
        raise ConnectionError("Failed to resolve openaipublic.blob.core.windows.net\nmore detail")

    monkeypatch.setattr(tiktoken, "get_encoding", unavailable)
    with pytest.raises(TokenizerError, match="TIKTOKEN_CACHE_DIR") as info:
        GPT2Tokenizer()
    assert "\n" not in str(info.value)


def test_a_cut_gpt2_vocabulary_is_the_bpe_of_its_first_merges(gpt2_tokenizer):
    small = GPT2Tokenizer(512)
    ids = small.encode(TEXT)
    assert max(ids) < 512 and small.decode(ids) == TEXT
    # Every token of the cut vocabulary is GPT-2's token of the same id.
    assert all(gpt2_tokenizer.decode([i]) == small.decode([i]) for i in range(256, 512))
    assert len(ids) > len(gpt2_tokenizer.encode(TEXT))  # fewer merges, more tokens
    assert tokenizer_from_dict(small.to_dict()) == small != gpt2_tokenizer
    assert gpt2_tokenizer.to_dict() == {"kind": "gpt2"}  # checkpoints of the full vocabulary are unchanged


@pytest.mark.parametrize("size", [255, 50258, 300.0, True])
def test_a_gpt2_vocabulary_size_outside_the_bpe_is_refused(size):
    with pytest.raises(TokenizerError, match="256 .*to 50257"):
        GPT2Tokenizer(size)


@pytest.mark.slow  # a second pytest session in a new process
def test_tests_needing_gpt2s_files_skip_with_a_reason_without_them(tmp_path):
    """A clone without ../shared beside it: an empty tiktoken cache, and no download (conftest)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rs",
         "tests/test_bad_values.py", "-k", "gpt2"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and "3 skipped" in run.stdout, run.stdout[-2000:]
    assert "GPT-2 BPE files unavailable" in run.stdout and not list(tmp_path.iterdir())
