"""Cloud OS Login API emulator (the v1 subset the pipeline uses), served by the compute emulator's
process beside the Compute API (it knows the VMs whose sshd asks it for keys).

- store: login profiles (POSIX accounts, SSH public keys with their expiry), the request log
- api: the REST routes under /v1/users/ (oslogin v1 discovery document), answers in the API's shape
- guest: the VM side, guest-oslogin's `google_authorized_keys` as sshd's AuthorizedKeysCommand,
  asking the emulator over a local socket; only keys whose expiry has not passed are printed
"""
