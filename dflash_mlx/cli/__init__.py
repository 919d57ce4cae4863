"""The ``dflash-mlx`` command line (``main``): a thin layer over the library; its helpers parse flags (``checks``),
name models (``pairs``), print (``output``, ``progress``) and run the chat and bench commands' loops.

The top layer: may import every other package; nothing imports it.
"""
