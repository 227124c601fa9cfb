"""The one writer: every step keras-orbax writes (`save`, the callback, `convert`) goes through
`step_writer` and its shard writer: writer lock, checksums per shard file, durable before commit."""
