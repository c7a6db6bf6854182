# The image docker-compose.yaml builds: Airflow's official image at the Airflow and Python versions
# of requirements.lock, with the lock installed on top. dags/, plugins/ and include/ are not copied
# in: the compose file mounts them, so a change needs no rebuild.
FROM apache/airflow:3.3.2-python3.11

# The image installs Python packages as the airflow user. `pip install -r` puts every locked version
# in place and leaves the image's other packages (providers the lock does not name) alone; a sync
# would remove them. The lock pins apache-airflow itself, so Airflow's version cannot move.
USER airflow
COPY requirements.lock /opt/maxtext-sft/requirements.lock
RUN pip install --no-cache-dir -r /opt/maxtext-sft/requirements.lock

# No Google Cloud CLI: the tasks reach Google Cloud through the client libraries and the VMs by
# paramiko (no ssh binary). Only the opt-in Param ssh_via_iap runs `gcloud compute start-iap-tunnel`,
# and then gcloud needs its own credentials on every worker too (it does not read Airflow's
# connection). A team that uses it extends this image with Google's Cloud CLI package (install it as
# root from Google's Debian repository, following Google's install guide) and gives gcloud an account.
