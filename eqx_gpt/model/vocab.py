"""Vocabulary padding: round the embedding table up to a hardware-friendly size."""


def pad_vocab(n: int, multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that is >= `n` (65 -> 128, 50257 -> 50304).

    Matrix multiplies whose sizes are multiples of 64 hit the fast paths of GPUs and TPUs; the
    extra rows of the embedding table are never produced as tokens (see `GPT.__call__`).
    """
    if n < 1 or multiple < 1:
        raise ValueError(f"pad_vocab needs n >= 1 and multiple >= 1, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple
