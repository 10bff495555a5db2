// A real OpenID Connect provider (the npm package oidc-provider) for the single sign-on tests.
//
//   node tests/oidc/provider.mjs   with PORT, CLIENT_ID, CLIENT_SECRET, REDIRECT_URI, ACCOUNTS
//
// ACCOUNTS is a JSON object login -> extra claims (email, email_verified, groups, preferred_username);
// any other login signs in with only its sub. The provider's development login and consent pages are
// the interaction: the tests fill them in as a person would. Prints "ready <issuer>" once it listens.
import Provider from "oidc-provider";

const port = Number(process.env.PORT);
const issuer = `http://127.0.0.1:${port}`;
const accounts = JSON.parse(process.env.ACCOUNTS || "{}");

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: process.env.CLIENT_ID,
      client_secret: process.env.CLIENT_SECRET,
      redirect_uris: process.env.REDIRECT_URI.split(","),
      response_types: ["code"],
      grant_types: ["authorization_code"],
      token_endpoint_auth_method: "client_secret_post",
    },
  ],
  claims: {
    openid: ["sub"],
    email: ["email", "email_verified"],
    profile: ["preferred_username", "name"],
    groups: ["groups"],
  },
  pkce: { required: () => false },
  findAccount: async (ctx, sub) => ({
    accountId: sub,
    claims: async () => ({ sub, ...(accounts[sub] || {}) }),
  }),
});
provider.proxy = false;

provider.listen(port, "127.0.0.1", () => {
  console.log(`ready ${issuer}`);
});
