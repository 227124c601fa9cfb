"""`ModelCheckpoint` during `fit`: background saves, retention, resume, preemption."""
