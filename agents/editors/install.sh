#!/bin/sh
# Install code-server (VS Code in the browser) here, under node_modules/, from the npm registry and
# this host's own files alone: nothing is fetched from GitHub or nodejs.org, so it also works on a
# host that reaches only the npm registry and Debian's mirror (agents/README.md, "VS Code").
#
# npm's ordinary install of code-server runs postinstall steps that download: @vscode/ripgrep's
# fetches rg from api.github.com, and node-gyp fetches node's headers from nodejs.org for the native
# modules. So the packages come with --ignore-scripts from the lock files (ours, then code-server's
# own npm-shrinkwrap.json for lib/vscode), the native modules are built against the headers of the
# node that will run them (npm_config_nodedir, /usr for Debian's or NodeSource's nodejs), rg is
# Debian's ripgrep, and the rest of code-server's postinstall.sh is done below.
#
# Needs: node 20 (code-server 4.100 is built for it) with its headers under $npm_config_nodedir/
# include/node, a C++ toolchain and Python (build-essential, python3), libkrb5-dev (kerberos), and
# ripgrep. About a minute on 2 cores; about 310 MB.
set -eu
cd "$(dirname "$0")"
nodedir="${npm_config_nodedir:-$(dirname "$(dirname "$(command -v node)")")}"
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" != 20 ]; then
  echo "install.sh: code-server 4.100 needs node 20, this is node $(node -v)" >&2
  exit 1
fi
if [ ! -f "$nodedir/include/node/node_api.h" ]; then
  echo "install.sh: no node headers under $nodedir/include/node (set npm_config_nodedir)" >&2
  exit 1
fi
rg="$(command -v rg || true)"
if [ -z "$rg" ]; then
  echo "install.sh: ripgrep (rg) is not on PATH: apt-get install ripgrep" >&2
  exit 1
fi
export npm_config_nodedir="$nodedir"
gyp="$PWD/node_modules/node-gyp/bin/node-gyp.js"
quiet="--no-audit --no-fund --silent"

npm ci --ignore-scripts $quiet
(cd node_modules/argon2 && ../.bin/node-pre-gyp rebuild --build-from-source --loglevel=error >/dev/null)

vscode=node_modules/code-server/lib/vscode
# npm install, as its postinstall.sh does: its npm-shrinkwrap.json pins all but one package (tslib)
(cd "$vscode" && npm install --omit=dev --ignore-scripts $quiet)
for module in kerberos @vscode/spdlog native-watchdog node-pty; do
  (cd "$vscode/node_modules/$module" && node "$gyp" rebuild --loglevel=error -j 2 >/dev/null)
done
mkdir -p "$vscode/node_modules/@vscode/ripgrep/bin"
ln -sfn "$rg" "$vscode/node_modules/@vscode/ripgrep/bin/rg"
# what code-server's postinstall.sh does besides installing
ln -sfn node_modules "$vscode/node_modules.asar"
ln -sfn code-linux.sh "$vscode/bin/remote-cli/code-server"
ln -sfn browser-linux.sh "$vscode/bin/helpers/browser.sh"
(cd "$vscode/extensions" && npm install --omit=dev --ignore-scripts $quiet && node postinstall.mjs >/dev/null)

node node_modules/code-server/out/node/entry.js --version
