"""Loading: the reader that verifies and decodes chunks into tensors (`reader`), where chunks come
from (`sources`: a local file, a store, memory), the writing back into a state (`restore`), and a
damaged file's reads in a child process (`isolated`).

May import: `core`, `codecs`, `format`, `engine`, `stores`, `errors`, `stats`."""
