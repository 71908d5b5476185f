"""The data wing: a corpus of any size, tokenized once into token shards on disk.

`sources` finds and reads the files of `--data PATH` (text, .jsonl, each maybe compressed, and
tables: `formats`) and says what it read and skipped; `chunks` cuts them into units of work;
`prepare` tokenizes them into shards in the cache (`cache`), described by a `manifest`, or opens
and verifies the shards a previous run wrote; `shards` reads windows of tokens from them, always
from the version of the cache a reader opened. It knows nothing of models or training:
`training/data.py` uses it.
"""
