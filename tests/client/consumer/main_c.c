/* consumer_c SOCKET: the C API of an installed libkvd (kvd/kvd.h, libkvd_c.so): connects to a running kvd,
 * creates and attaches a pool, writes and reads its memory through the Mapping, grows it, and deletes it.
 * Exit 0 when everything worked. */
#include <stdio.h>
#include <string.h>

#include "kvd/kvd.h"

static int fail(const char* what, kvd_status* st) {
  fprintf(stderr, "%s: %s: %s\n", what, kvd_code_name(kvd_status_code(st)), kvd_status_message(st));
  kvd_status_free(st);
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  kvd_status* st = NULL;
  kvd_connect_options* co = kvd_connect_options_create();
  kvd_connect_options_set_socket(co, argv[1]);
  kvd_connect_options_set_client_name(co, "consumer-c");
  kvd_client* client = NULL;
  const int connected = kvd_connect(co, &client, &st);
  kvd_connect_options_destroy(co);
  if (connected != KVD_OK) return fail("connect", st);

  kvd_pool_options* po = kvd_pool_options_create("consumer-c");
  const kvd_dims dims = {
      .layers = 2, .capacity_blocks = 1024, .heads = 2, .block_tokens = 16, .channels = 64, .element_bytes = 2};
  kvd_pool_options_set_dims(po, &dims);
  kvd_pool_options_set_initial_blocks(po, 512);
  const int created = kvd_client_create_pool(client, po, NULL, &st);
  kvd_pool_options_destroy(po);
  if (created != KVD_OK) return fail("create", st);

  kvd_mapping* m = NULL;
  if (kvd_client_attach(client, "consumer-c", NULL, &m, &st) != KVD_OK) return fail("attach", st);
  unsigned char* layer = kvd_mapping_layer(m, 1);
  memset(layer, 0x5a, kvd_mapping_geometry(m)->stride_b);
  if (layer[kvd_mapping_geometry(m)->stride_b - 1] != 0x5a) return 1;
  if (kvd_client_grow(client, "consumer-c", 1024, NULL, &st) != KVD_OK) return fail("grow", st);
  printf("consumer_c: pool %s, layout %s, %lu blocks mapped at %p\n", kvd_mapping_pool(m),
         kvd_mapping_geometry(m)->layout, (unsigned long)kvd_mapping_committed_blocks(m), kvd_mapping_base(m));
  if (kvd_mapping_committed_blocks(m) != 1024) return 1;
  kvd_mapping_close(m);

  kvd_buffer reply = {NULL, 0};
  if (kvd_client_delete_pool(client, "consumer-c", NULL, &reply, &st) != KVD_OK) return fail("delete", st);
  kvd_buffer_free(&reply);
  kvd_client_close(client);
  return 0;
}
