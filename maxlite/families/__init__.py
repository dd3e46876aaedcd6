"""One module per model family: its data (`FAMILY`, a maxlite.models.families.Family whose
`hf_module` is the module itself) and its Hugging Face adapter (tensor names, config.json keys both
ways; the chat template travels with the tokenizer files). maxlite.models.families finds every module
here; the bridge, the NeMo mapping and PEFT read the registry. docs/families.md says how to add one.
"""
