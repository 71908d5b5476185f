"""The commands, each a `main(argv, prog)` returning an exit code: `python -m eqx_gpt NAME`, the
`eqx-gpt NAME` console script, and the root scripts `NAME.py` of a clone all run them.

    train      train a GPT (every `GPTConfig` and `TrainConfig` field is a flag)
    sample     stream text from a checkpoint
    evaluate   a checkpoint's loss over a whole text
    export     a GPT-2-shaped checkpoint as a Hugging Face GPT-2 folder
    serve      an OpenAI-compatible completions API and a page (needs the `serve` extra)
    cli        what they share: the one place errors are caught, the parser, the flags' types
"""

COMMANDS = ("train", "sample", "evaluate", "export", "serve")
