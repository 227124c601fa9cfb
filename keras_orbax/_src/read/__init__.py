"""Region reads onto devices: planning which reader serves each array, reading ahead in a byte
window, coalescing cut rows, sharing replicated regions across processes."""
