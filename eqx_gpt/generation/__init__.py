"""The generation wing: choosing a token from logits (`sampling`) and the KV-cached decoding loops
(`generate` for a GPT). Import them from `eqx_gpt`."""
