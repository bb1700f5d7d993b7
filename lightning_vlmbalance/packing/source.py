"""Moved to :mod:`lightning_vlmbalance.balance.source` (release 0.2). Its names still resolve
here, with a ``DeprecationWarning``; objects pickled under this module path load too."""

from lightning_vlmbalance._moved import moved

__getattr__ = moved(__name__, "lightning_vlmbalance.balance.source", globals())
