# lib.sh - shared by deploy/check/*.sh (bash; sourced, not run): the
# Debian mirror of this machine's apt sources, and Debian 12 roots made
# with debootstrap, kept for a day in $STORE.
#
# No mirror or registry is named here: debootstrap gets the one apt
# itself uses on this machine, read from /etc/apt/sources.list.d/*.sources
# (deb822) and *.list, then /etc/apt/sources.list, and apt's proxy
# (Acquire::http::Proxy) when one is set.

# apt_mirror [SUITE]: prints the URI of the first enabled "deb" source of
# SUITE (default bookworm); else of the first one whose suite is a plain
# release name (no "-updates", "-security" or "/"), which serves the other
# releases too.  False, printing nothing, when there is none.
apt_mirror() {
  local suite=${1:-bookworm} f
  local -a files=()
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
           /etc/apt/sources.list; do
    [ -f "$f" ] && files+=("$f")
  done
  [ ${#files[@]} -gt 0 ] || return 1
  awk -v want="$suite" '
    # One source a record: Types, URIs, Suites (as deb822 names them).
    function flush() {
      if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "") {
        n = split(suites, s, " ")
        split(uris, u, " ")
        for (i = 1; i <= n; i++) {
          if (s[i] == want && exact == "") exact = u[1]
          if (s[i] !~ /[-\/]/ && plain == "") plain = u[1]
        }
      }
      types = ""; uris = ""; suites = ""; enabled = ""
    }
    FNR == 1 { flush(); deb822 = (FILENAME ~ /\.sources$/) }
    deb822 {
      if ($0 ~ /^[ \t]*$/) { flush(); next }
      if ($0 ~ /^#/) next
      key = tolower($1); sub(/:$/, "", key)
      val = $0; sub(/^[^:]*:[ \t]*/, "", val)
      if (key == "types") types = val
      else if (key == "uris") uris = val
      else if (key == "suites") suites = val
      else if (key == "enabled") enabled = tolower(val)
      next
    }
    # One-line style: deb [options] URI SUITE COMPONENT...
    $1 == "deb" {
      i = 2
      if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
      types = "deb"; uris = $i; suites = $(i + 1); flush()
    }
    END {
      flush()
      if (exact != "") print exact; else if (plain != "") print plain
      else exit 1
    }' "${files[@]}"
}

# apt_proxy: exports http_proxy from apt's Acquire::http::Proxy when it is
# set and the environment has none (debootstrap reads the environment).
apt_proxy() {
  local http_proxy_apt=""
  if [ -z "${http_proxy:-}" ] && command -v apt-config >/dev/null 2>&1; then
    eval "$(apt-config shell http_proxy_apt Acquire::http::Proxy)"
    [ -n "$http_proxy_apt" ] && export http_proxy=$http_proxy_apt
  fi
  return 0
}

# debian_root NAME LOG [PACKAGES]: prints the path of a tarball of a
# Debian 12 minbase root (with PACKAGES, comma-separated, added), made with
# debootstrap from apt_mirror's mirror and kept in $STORE for a day.
# False, after saying why on stderr, when it cannot be made.
debian_root() {
  local name=$1 log=$2 pkgs=${3:-} tar=$STORE/$1.tar mirror t0
  mkdir -p "$STORE"
  if [ -f "$tar" ] && [ -n "$(find "$tar" -mmin -1440)" ]; then
    echo "check: reusing the Debian root $name made $(stat -c %y "$tar" | cut -d. -f1)" >&2
    echo "$tar"
    return 0
  fi
  if ! command -v debootstrap >/dev/null 2>&1; then
    echo "debootstrap is not installed (Debian package debootstrap)" >&2
    return 1
  fi
  if ! mirror=$(apt_mirror bookworm); then
    echo "no Debian mirror in this machine's apt sources" >&2
    return 1
  fi
  apt_proxy
  rm -rf "$STORE/$name.d" "$tar"
  t0=$(date +%s)
  if debootstrap --variant=minbase ${pkgs:+--include="$pkgs"} bookworm \
       "$STORE/$name.d" "$mirror" >"$log" 2>&1 &&
     tar -C "$STORE/$name.d" -cf "$tar" .; then
    echo "check: debootstrap bookworm minbase${pkgs:+ + $pkgs} from $mirror: $(( $(date +%s) - t0 )) s" >&2
    rm -rf "$STORE/$name.d"
    echo "$tar"
    return 0
  fi
  rm -rf "$STORE/$name.d" "$tar"
  echo "debootstrap from $mirror failed (log: $log)" >&2
  return 1
}

# The host's network and firewall as found, to compare at the end of a run
# (check-deploy.sh): what a container engine most often leaves behind is a
# bridge, its routes and its NAT/filter rules.
#
# host_net: the names of the links (without "@peer"), every route of
# every table (IPv4 and IPv6), sorted, and whether the host forwards (a
# bridge plugin turns ip_forward on in the namespace it runs in).
host_net() {
  { ip -o link show | awk -F': ' '{ print $2 }' | sed 's/@.*//' | sort
    ip route show table all 2>/dev/null | sort
    grep -H . /proc/sys/net/ipv4/ip_forward \
      /proc/sys/net/ipv6/conf/all/forwarding; } 2>/dev/null
}

# host_fw_tools: the firewall dumpers there are on this machine (iptables
# through nf_tables and legacy, IPv4 and IPv6, and nft).  Taken once, at the
# start, so that a tool installed during the run changes nothing.
host_fw_tools() {
  local t
  for t in iptables-save ip6tables-save iptables-legacy-save \
           ip6tables-legacy-save nft; do
    command -v "$t" >/dev/null 2>&1 && printf '%s ' "$t"
  done
  return 0
}

# host_fw TOOLS...: every table, chain and rule those tools list, each
# line prefixed with the tool's name; counters ([packets:bytes] and nft's
# "counter packets N bytes N") and the "# Generated by" comments are
# taken out, so that only a change of rules shows.  Listing does not
# create tables or load modules (iptables-save reads the tables the kernel
# has; nft list is read-only).
host_fw() {
  local t
  for t in "$@"; do
    case $t in
      nft) nft -s list ruleset 2>&1 ;;
      *) "$t" 2>&1 ;;
    esac | sed -e '/^#/d' -e 's/\[[0-9]*:[0-9]*\]/[0:0]/g' \
               -e 's/counter packets [0-9]* bytes [0-9]*/counter/g' |
      sed "s/^/$t: /"
  done
}
