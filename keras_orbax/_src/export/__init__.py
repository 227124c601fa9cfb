"""The sinks: a sharded model written in the formats people share (`.weights.h5`, keras-hub presets,
Hugging Face safetensors) region by region, without any host or device holding a whole variable."""
