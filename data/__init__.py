"""Data shipped with specboost: the bundled prompt sets (`prompts/`), found through
`importlib.resources` (see `specboost.speculator.prompt_sets`). The corpus (`corpus/`) is only
in a source checkout: it builds the reference LLM and the benchmark fixtures."""
