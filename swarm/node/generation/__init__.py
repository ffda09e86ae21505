"""Generations as a service: requests in, tokens and a receipt out, across re-plans.

    service.py     the generation service (in-process for the API, and /shard-swarm/gen/1):
                   requests, relaying, the coordinator's run
    resume.py      a generation outliving its ring: wait for the next epoch, resume by replay
    report.py      receipts and status
    genwire.py     a gen/1 stream's messages, however long: sent in pieces, received whole
    genstream.py   the one client of a generation's stream (CLI, API, a relaying node): the
                   reader and its timeout rule, resume after a lost coordinator, receipt stitching
    ringview.py    build_view: a status dict -> the ring as a person reads it (status command, web console)

Imports every other plane (plan/, members/, ring/, compute/) and node/'s shared modules.
"""
