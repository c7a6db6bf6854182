"""Google Cloud and the Hub as the tasks reach them: the hooks (each owns one client; endpoints
settable on the connection), the table of Compute Engine errors, the instances' labels and
adoption, and the triggers that wait on the cloud (a reservation's capacity, a slice's hosts).

May import `run`, `results` and `ui`.
"""
