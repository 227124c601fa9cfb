"""Where bytes live and how they are reached: locations (local, `gs://`, `s3://`), byte runs and
aligned buffers, mapped and small files, durability, the writer lock."""
