#!/bin/sh
# This pod's certificate for Ray's mutual TLS (RAY_USE_TLS): a fresh key, signed by the cluster's CA, valid for
# the names and addresses other Ray processes dial this pod by. Run by every Ray pod's init container ray-tls-cert
# (ConfigMap kvstack-ray-tls); tests/integration/test_ray_access.py runs this file against a real Ray cluster.
#
# In:  RAY_TLS_CA_DIR  holds ca.crt and ca.key (the Secret kvstack-ray-ca, see k8s/README.md)
#      RAY_TLS_DIR     where to write tls.key, tls.crt and ca.crt (an emptyDir the Ray container mounts)
#      POD_IP          this pod's IP (downward API); RAY_TLS_EXTRA_IPS: more IPs, space-separated (optional)
#      POD_NAMESPACE   names *.NAMESPACE.svc[.cluster.local] (the head's Service, which workers dial; optional)
#      FQ_RAY_IP       the head Service's name as KubeRay gives it to workers (optional)
set -eu
: "${RAY_TLS_CA_DIR:?}" "${RAY_TLS_DIR:?}" "${POD_IP:?}"
san="DNS:localhost,IP:127.0.0.1,IP:${POD_IP}"
for ip in ${RAY_TLS_EXTRA_IPS:-}; do san="${san},IP:${ip}"; done
if [ -n "${POD_NAMESPACE:-}" ]; then
  san="${san},DNS:*.${POD_NAMESPACE},DNS:*.${POD_NAMESPACE}.svc,DNS:*.${POD_NAMESPACE}.svc.cluster.local"
fi
if [ -n "${FQ_RAY_IP:-}" ]; then
  case "${FQ_RAY_IP}" in
    *[!0-9.]*) san="${san},DNS:${FQ_RAY_IP}" ;;
    *) san="${san},IP:${FQ_RAY_IP}" ;;
  esac
fi
mkdir -p "${RAY_TLS_DIR}"
umask 077
ext="${RAY_TLS_DIR}/ext.cnf"
{
  printf 'subjectAltName=%s\n' "${san}"
  printf 'keyUsage=critical,digitalSignature,keyEncipherment\n'
  printf 'extendedKeyUsage=serverAuth,clientAuth\n'  # the same certificate serves and dials (mutual TLS)
} > "${ext}"
openssl req -new -newkey rsa:2048 -nodes -subj "/CN=kvstack-ray" \
  -keyout "${RAY_TLS_DIR}/tls.key" -out "${RAY_TLS_DIR}/tls.csr" 2>/dev/null
openssl x509 -req -in "${RAY_TLS_DIR}/tls.csr" -CA "${RAY_TLS_CA_DIR}/ca.crt" -CAkey "${RAY_TLS_CA_DIR}/ca.key" \
  -set_serial "0x$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')" -days 365 -sha256 -extfile "${ext}" \
  -out "${RAY_TLS_DIR}/tls.crt" 2>/dev/null
cp "${RAY_TLS_CA_DIR}/ca.crt" "${RAY_TLS_DIR}/ca.crt"
rm -f "${RAY_TLS_DIR}/tls.csr" "${ext}"
echo "ray-tls: certificate for ${san}"
