"""The model wing: the parts of "Attention Is All You Need" as Equinox modules, and the models built
from them (`GPT`, decoder-only; `Transformer`, the encoder-decoder). Import them from `eqx_gpt`."""
