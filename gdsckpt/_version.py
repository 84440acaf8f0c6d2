"""The library's version and the file format version it writes, in their own module so that any
module can import them without a cycle, and without torch (`gdsckpt --version`)."""

__version__ = "0.1.0"
FORMAT_MAJOR, FORMAT_MINOR = 1, 1  # FORMAT.md; format.py's MAJOR, MINOR
