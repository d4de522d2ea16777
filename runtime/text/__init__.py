"""The engine's text: its tokenizer, chat templates run in a sandbox, prompts to token ids."""
