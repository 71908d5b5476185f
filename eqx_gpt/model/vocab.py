"""Vocabulary padding: round the embedding table up to a hardware-friendly size."""

from eqx_gpt._checks import check_size


def pad_vocab(n: int, multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that is >= `n` (65 -> 128, 50257 -> 50304).

    Matrix multiplies whose sizes are multiples of 64 hit the fast paths of GPUs and TPUs; the
    extra rows of the embedding table are never produced as tokens (see `GPT.__call__`).
    """
    check_size(n, "pad_vocab: n (the vocabulary size)")
    check_size(multiple, "pad_vocab: multiple")
    return -(-n // multiple) * multiple
