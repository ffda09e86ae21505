"""Sans-IO wire protocol: frames, messages and limits. No trio, no libp2p, no torch."""
