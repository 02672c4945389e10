"""The data plane: NATS JetStream, and everything that crosses it.

``broker`` owns every subject, stream and bucket name (``subjects``), every wire message
(``messages``), the only code that turns messages into bytes and back (``codec``), run
provisioning (``provision``), the embedded ``nats-server`` (``server``), validated ingress with
dead-lettering (``ingress``) and the broker's own metrics (``metrics``). Other parts talk to each
other only through these.
"""
