"""The commands, each a `main(argv, prog)` returning an exit code: `python -m eqx_gpt NAME`, the
`eqx-gpt NAME` console script, and the root scripts `NAME.py` of a clone all run them.

    train      train a GPT (every `GPTConfig` and `TrainConfig` field is a flag)
    sample     stream text from a checkpoint
    evaluate   a checkpoint's loss over a whole text
    export     a GPT-2-shaped checkpoint as a Hugging Face GPT-2 folder
    serve      an OpenAI-compatible completions API and a page (needs the `serve` extra)
    cli        what they share: the one place errors are caught, the parser, the flags' types
"""

# Each command and the line `eqx-gpt --help` shows for it; a new command is one row here and a module
# `eqx_gpt.commands.NAME` with `main(argv, prog)`.
COMMANDS = {
    "train": "train a GPT on Tiny Shakespeare or your text (every GPTConfig and TrainConfig field is a flag)",
    "sample": "stream text from a checkpoint or a Hugging Face GPT-2 folder",
    "evaluate": "a checkpoint's mean loss over its validation split or a text of your own",
    "export": "write a GPT-2-shaped checkpoint as a Hugging Face GPT-2 folder",
    "serve": "an OpenAI-compatible completions API and a page for a checkpoint (needs the serve extra)",
}
