"""ds4f: a disk-streaming inference engine for DeepSeek-V4-Flash.

Subpackages: ds4f.engine (everything that is not UI), ds4f.console (the Textual app),
ds4f.themes (themes and stylesheets), ds4f.native (the compiled C kernels).
"""
__version__ = "0.1.0"
