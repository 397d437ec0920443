"""How a rank is started and how it ends: each launcher's environment mapped onto torch.distributed's, and
failures, collective timeouts and signals ending the whole job fast."""
