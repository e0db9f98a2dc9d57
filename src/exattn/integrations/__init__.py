"""Integrations with other libraries, each imported on its own so its library stays optional.

- `exattn.integrations.transformers`: `attn_implementation="exattn"` for
  HuggingFace transformers models (importing it registers the name).
"""
