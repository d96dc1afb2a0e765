"""The training recipe of Outrider's tiny model family (not part of the installed daemon).

Run it as ``python recipe/train.py STAGE``; see recipe/README.md.
"""
