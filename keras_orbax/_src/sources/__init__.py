"""One `Source` per kind of saved state, and the one function that decides what a location names
(`resolve.open_source`)."""
