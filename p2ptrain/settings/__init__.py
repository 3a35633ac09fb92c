"""A node's settings (p2ptrain/config.py holds NodeConfig for now).

  parsers.py      the small languages inside settings ("0=4,3=2", "RANK@STEP", "0<->2:1", "1,2|any")
"""
