/* A SeamlessFlow client in C (nats.c): publish one task, as JSON, to a run's task stream.
 * Usage: submit_task NATS_URL SUBJECT TASK_JSON [IDENTITY_FILE]
 * IDENTITY_FILE: an identity from `seamlessflow creds` (docs/protocol.md section 14); its seed
 * signs the server's challenge (nats.c reads the line starting with "SU" from the file) and
 * its inbox_prefix is where replies arrive. Prints the JetStream acknowledgement as JSON. */
#include <nats/nats.h>
#include <stdio.h>
#include <string.h>

/* The value of `key = "value"` in the flat TOML identity file, into out. */
static int identity_value(const char *path, const char *key, char *out, size_t size) {
    FILE *f = fopen(path, "r");
    char line[512];
    size_t n = strlen(key);
    if (f == NULL) return 0;
    while (fgets(line, sizeof line, f) != NULL) {
        char *open, *close;
        if (strncmp(line, key, n) != 0 || (line[n] != ' ' && line[n] != '=')) continue;
        open = strchr(line, '"');
        close = open ? strchr(open + 1, '"') : NULL;
        if (open && close && (size_t)(close - open - 1) < size) {
            memcpy(out, open + 1, close - open - 1);
            out[close - open - 1] = '\0';
            fclose(f);
            return 1;
        }
    }
    fclose(f);
    return 0;
}

int main(int argc, char **argv) {
    natsConnection *nc = NULL;
    natsOptions *opts = NULL;
    jsCtx *js = NULL;
    jsPubAck *ack = NULL;
    jsErrCode jerr = 0;
    natsStatus s;
    char public_key[128], inbox[256];

    if (argc < 4) {
        fprintf(stderr, "usage: %s NATS_URL SUBJECT TASK_JSON [IDENTITY_FILE]\n", argv[0]);
        return 2;
    }
    s = natsOptions_Create(&opts);
    if (s == NATS_OK) s = natsOptions_SetURL(opts, argv[1]);
    if (s == NATS_OK) s = natsOptions_SetTimeout(opts, 5000);
    if (s == NATS_OK && argc > 4) {
        if (!identity_value(argv[4], "public_key", public_key, sizeof public_key) ||
            !identity_value(argv[4], "inbox_prefix", inbox, sizeof inbox)) {
            fprintf(stderr, "%s: no public_key or inbox_prefix\n", argv[4]);
            return 2;
        }
        s = natsOptions_SetNKeyFromSeed(opts, public_key, argv[4]);
        if (s == NATS_OK) s = natsOptions_SetCustomInboxPrefix(opts, inbox);
    }
    if (s == NATS_OK) s = natsConnection_Connect(&nc, opts);
    if (s == NATS_OK) s = natsConnection_JetStream(&js, nc, NULL);
    if (s == NATS_OK) s = js_Publish(&ack, js, argv[2], argv[3], (int)strlen(argv[3]), NULL, &jerr);
    if (s == NATS_OK) {
        printf("{\"stream\": \"%s\", \"seq\": %llu, \"duplicate\": %s}\n", ack->Stream,
               (unsigned long long)ack->Sequence, ack->Duplicate ? "true" : "false");
        jsPubAck_Destroy(ack);
    } else {
        fprintf(stderr, "error: %s (%s)\n", natsStatus_GetText(s), nats_GetLastError(NULL));
    }
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    natsOptions_Destroy(opts);
    nats_Close();
    return s == NATS_OK ? 0 : 1;
}
